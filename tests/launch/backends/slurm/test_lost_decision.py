"""How the Slurm backend decides that a job lost a node (dtrain.launch.backends.slurm.lost), from the
leases in the run directory and one TCP handshake with each suspect's slurmd port. Where the nodes are
(``scontrol``: their NodeAddr and Port) is replaced by local ports here -- one listening, one closed,
one that answers nothing -- the only stand-in; tests/launch/backends/slurm/faults/test_lost_node_slurm.py runs the real faults.
The records are signed with the job's lease key, as the nodes' lease holders sign them; a beat's age is
planted (the kernel sets a file's ctime, which a test cannot back-date: tests/launch/node/test_lease_forgery.py
checks that reading)."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from dtrain.launch.backends.slurm import lost
from dtrain.launch.core.lost import shows_a_lost_node
from dtrain.launch.node import lease
from dtrain.launch.node.lease import BEAT, FENCE, beat_name, fenced_name, record
from dtrain.rundir import LEASE, RunDir

#: the dtrain job whose leases are decided on (Slurm's job id is "7")
JOB = "dtrain-0123456789ab"
SECRET = "5e" * 32
KEY = lost.job_key(JOB, {"secret": SECRET})


@pytest.fixture
def ports(monkeypatch):
    listening = socket.create_server(("127.0.0.1", 0))  # a live (or frozen) host's kernel completes the handshake
    closed = socket.create_server(("127.0.0.1", 0))
    refused = closed.getsockname()[1]
    closed.close()  # a crashed host's kernel refuses
    # A partitioned host answers nothing: a listener whose accept queue is full drops every further SYN.
    silent = socket.create_server(("127.0.0.1", 0), backlog=0)
    queued = []
    for _ in range(3):
        client = socket.socket()
        client.settimeout(0.2)
        try:
            client.connect(silent.getsockname())
        except OSError:
            pass
        queued.append(client)
    monkeypatch.setattr(lost, "PROBE_TIMEOUT_S", 0.5)
    yield {"alive": ("127.0.0.1", listening.getsockname()[1]), "gone": ("127.0.0.1", refused),
           "cut": ("127.0.0.1", silent.getsockname()[1])}
    for sock in (listening, silent, *queued):
        sock.close()


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """(run_dir, hosts: the (address, port) of each node by index, asked: the job ids Slurm was asked about)."""
    run_dir = RunDir(str(tmp_path / "run"))
    run_dir.ensure_dir(LEASE, JOB)
    hosts: list[tuple[str, int]] = []
    asked: list[str] = []

    def job_hosts(job_id: str):
        asked.append(job_id)
        return list(hosts)

    monkeypatch.setattr(lost, "job_hosts", job_hosts)
    real_age_of = lease.age_of
    monkeypatch.setattr(lease, "age_of", lambda files, now, *parts: AGES.get(parts, real_age_of(files, now, *parts)))
    AGES.clear()
    return run_dir, hosts, asked


#: (LEASE, job, beat file) -> the age planted for it
AGES: dict[tuple[str, ...], float] = {}


def beat(run_dir: RunDir, node: int, age: float, job: str = JOB) -> None:
    key = lost.job_key(job, {"secret": SECRET})
    run_dir.write(LEASE, job, beat_name(node), data=record(key, BEAT, node, {"time": time.time() - age}))
    AGES[(LEASE, job, beat_name(node))] = age


def fence(run_dir: RunDir, node: int, reason: str, job: str = JOB) -> None:
    key = lost.job_key(job, {"secret": SECRET})
    run_dir.write(LEASE, job, fenced_name(node), data=record(key, FENCE, node, {"time": time.time(), "reason": reason}))


def decide(run_dir: RunDir, failed: bool = False, lost_after: float = 30.0, report=None):
    return lost.lost_node(JOB, "7", run_dir.path, 2, lost_after, failed=failed, key=KEY,
                          **({"report": report} if report else {}))


def test_fresh_beats_and_no_fence_ask_nobody(cluster, ports):
    run_dir, hosts, asked = cluster
    assert decide(run_dir) is None  # nothing started beating yet
    beat(run_dir, 0, 1.0)
    beat(run_dir, 1, 4.0)
    assert decide(run_dir) is None and asked == []  # a running job costs a stat per node, no probe


def test_a_stale_beat_and_an_answering_kernel_is_a_frozen_node(cluster, ports):
    run_dir, hosts, _ = cluster
    hosts += [ports["alive"], ports["alive"]]
    beat(run_dir, 0, 1.0)
    beat(run_dir, 1, 20.0)
    found = decide(run_dir)
    assert (found.node, found.address, found.fault) == (1, "127.0.0.1", "frozen")
    assert "heartbeat is 20 s old" in found.detail


def test_a_stale_beat_and_a_refused_port_is_a_gone_node(cluster, ports):
    run_dir, hosts, _ = cluster
    hosts += [ports["alive"], ports["gone"]]
    beat(run_dir, 0, 1.0)
    beat(run_dir, 1, 16.0)
    assert decide(run_dir).fault == "gone"


def test_no_answer_counts_only_once_the_beat_is_older_than_lost_after(cluster, ports):
    run_dir, hosts, _ = cluster
    hosts += [ports["alive"], ports["cut"]]
    beat(run_dir, 0, 1.0)
    beat(run_dir, 1, 20.0)
    assert decide(run_dir) is None  # a blip so far
    beat(run_dir, 1, 31.0)
    found = decide(run_dir)
    assert (found.node, found.address, found.fault) == (1, "127.0.0.1", "unreachable")
    assert "within 0.5 s" in found.detail


def test_a_node_that_fenced_itself_is_lost_with_its_reason_even_if_it_answers(cluster, ports):
    run_dir, hosts, _ = cluster
    hosts += [ports["alive"], ports["alive"]]
    beat(run_dir, 0, 1.0)
    beat(run_dir, 1, 1.0)
    fence(run_dir, 1, "this node could not reach its peer")
    found = decide(run_dir)
    assert (found.node, found.fault) == (1, "unreachable")
    assert found.detail == "it fenced itself: this node could not reach its peer"


def test_after_a_failure_only_the_handshake_names_a_node_never_an_old_beat(cluster, ports):
    run_dir, hosts, _ = cluster
    hosts += [ports["alive"], ports["alive"]]
    beat(run_dir, 0, 120.0)
    beat(run_dir, 1, 120.0)  # the job ended a while ago: its beats stopped with it
    assert decide(run_dir, failed=True) is None
    hosts[1] = ports["gone"]
    assert decide(run_dir, failed=True).fault == "gone"  # the node that crashed and failed the job


def test_the_leases_of_the_job_a_retry_replaces_are_not_the_retrys(cluster, ports):
    """An Airflow retry runs in the same run directory. The job before it lost node 1: its beats went
    stale and node 1 fenced itself (and may still write there, once its link heals). The retry's nodes
    have not beaten yet, or beat fresh: nothing of the old job's is a sign of a lost node of this one."""
    run_dir, hosts, asked = cluster
    hosts += [ports["alive"], ports["alive"]]
    beat(run_dir, 0, 90.0, job="dtrain-before")
    beat(run_dir, 1, 120.0, job="dtrain-before")
    fence(run_dir, 1, "this node could not reach its peer", job="dtrain-before")
    assert decide(run_dir) is None and not shows_a_lost_node(run_dir.path, JOB, 2, KEY)
    beat(run_dir, 0, 1.0)
    beat(run_dir, 1, 1.0)
    assert decide(run_dir) is None and asked == []  # not even a probe


def test_nothing_is_decided_when_slurm_cannot_say_where_the_nodes_are(cluster, ports):
    run_dir, hosts, asked = cluster
    beat(run_dir, 1, 60.0)
    assert decide(run_dir) is None and asked == ["7"]


@pytest.mark.parametrize("lost_kind, fault", [("gone", "gone"), ("cut", "unreachable")])
def test_the_verdict_names_the_lost_node_not_its_peer_that_fenced_itself(cluster, ports, lost_kind, fault):
    """Node 0's peer is node 1: when node 1 is lost, node 0 fences itself too (it cannot reach it)."""
    run_dir, hosts, _ = cluster
    hosts += [ports["alive"], ports[lost_kind]]
    beat(run_dir, 0, 1.0)
    beat(run_dir, 1, 1.0)  # a partitioned node's beat stays fresh where the shared filesystem still reaches it
    fence(run_dir, 0, "could not reach its peer node 1")
    found = decide(run_dir)
    assert (found.node, found.fault) == (1, fault), found


def test_records_a_rank_wrote_decide_nothing_and_are_named(cluster, ports):
    """A rank can write the lease folder: an unsigned fence, a fence signed for another node, a stale
    beat of its own making. None is the holder's; each is named once per poll's report."""
    run_dir, hosts, asked = cluster
    hosts += [ports["alive"], ports["alive"]]
    beat(run_dir, 0, 1.0)
    run_dir.write(LEASE, JOB, fenced_name(1), data=json.dumps({"time": 1.0, "reason": "forged"}).encode())
    run_dir.write(LEASE, JOB, beat_name(1), data=json.dumps({"time": 1.0}).encode())
    AGES[(LEASE, JOB, beat_name(1))] = 600.0
    told = []
    assert decide(run_dir, report=told.append) is None and asked == []
    assert not shows_a_lost_node(run_dir.path, JOB, 2, KEY)
    assert [line.split(": ")[0] for line in told] == [f"[dtrain] node 1"] * 2, told
    assert f"refused the fence record {LEASE}/{JOB}/node1.fenced: not signed (no MAC)" in told[0]
    assert f"refused the beat record {LEASE}/{JOB}/node1.beat: not signed (no MAC)" in told[1]
    # node 0's genuine fence record, copied to node 1: signed for another node
    fence(run_dir, 0, "could not reach its peer")
    os.replace(run_dir.join(LEASE, JOB, fenced_name(0)), run_dir.join(LEASE, JOB, fenced_name(1)))
    told.clear()
    assert decide(run_dir, report=told.append) is None
    assert "signed for another record ('fence' of node 0)" in told[0], told


SCONTROL_NODES = (
    "NodeName=node1 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.231.123.11 NodeHostName=vm Port=36121 Version=22.05.8 "
    "State=IDLE\n"
    "NodeName=node2 Arch=x86_64 NodeAddr=10.231.123.12 NodeHostName=vm Version=22.05.8 State=IDLE\n"  # no Port=
    "NodeName=node3 NodeAddr=node3 Port=99999\n")  # out of range: the default


def test_scontrol_node_lines_give_each_nodes_slurmd_address_and_port():
    from dtrain.launch.backends.slurm.render import DEFAULT_SLURMD_PORT, parse_nodes

    assert parse_nodes(SCONTROL_NODES) == {"node1": ("10.231.123.11", 36121), "node2": ("10.231.123.12", DEFAULT_SLURMD_PORT),
                                           "node3": ("node3", DEFAULT_SLURMD_PORT)}


@pytest.mark.parametrize("nodes, node, expected", [
    (3, 0, ("h1", "h0")), (3, 2, ("h0", "h2")),  # the next node's slurmd; the last node's peer is node 0
    (1, 0, (None, "h0")),  # alone: no peer, its own slurmd still
    (2, 5, (None, None)), (0, 0, (None, None)),  # Slurm did not say: the clock check only
])
def test_each_node_leases_on_the_next_nodes_slurmd_and_its_own(monkeypatch, nodes, node, expected):
    from dtrain.launch.backends.slurm import node_lease

    monkeypatch.setattr(node_lease, "node_hosts", lambda node_list: [(f"h{i}", 6818) for i in range(nodes)])
    peer, own = node_lease.targets("node[1-3]", node)
    assert (peer and peer[0], own and own[0]) == expected
