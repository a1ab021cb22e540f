"""Elastic jobs (``nodes="MIN:MAX"``): the spec, the rendered agents, the launcher's bookkeeping of
nodes and rounds (pure), the rendezvous store's process, and on the local backend (simulated nodes)
a lost node's survivors going on, a script's own failure still failing the job. The namespace-cluster
faults are in tests/launch/backends/ssh/faults/test_elastic.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import psutil
import pytest

from dtrain.errors import SpecError
from dtrain.launch.backends.ssh.backend import SSHBackend
from dtrain.launch.core.elastic import Membership, Rounds, latest_step
from dtrain.launch.core.job import prepare_job
from dtrain.launch.core.lost import LostNode
from dtrain.launch.backends.placement import Placement
from dtrain.launch.core.rdzv_store import RendezvousStore
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.core.torchrun import Elastic, agent_argv
from dtrain.launch.engine.launcher import LaunchResult, Launcher
from dtrain.launch.node.elastic_rdzv import NO_ROUND_EXIT_CODE
from dtrain.launch.node.net import free_port
from dtrain.launch.node.rdzv_auth import StoreKey
from dtrain.pipeline.params import NODES_PATTERN, NODES_TYPE, _check_one
from tests.support import poll_until

from ..conftest import script

KEY = StoreKey("ab" * 32)  # a job's rendezvous key: its agents sign their round lines with it


def signed(body: str) -> str:
    """An agent's round line: ``body`` with its MAC."""
    return f"{body} mac={KEY.round_mac(body)}"

PY = "/opt/venv/bin/python"
CMD = [sys.executable, "-c", "pass"]


# -- the spec -----------------------------------------------------------------------------------------

def test_nodes_min_max_is_an_elastic_placement_and_a_count_is_not():
    spec = LaunchSpec(command=CMD, nodes="2:3", device="cpu")
    assert (spec.nodes, spec.min_nodes, spec.elastic, spec.placement.nnodes, spec.world_size) == (3, 2, True, "2:3", 3)
    fixed = LaunchSpec(command=CMD, nodes=" 3 : 3 ", device="cpu")  # MIN = MAX: a fixed job
    assert (fixed.nodes, fixed.min_nodes, fixed.elastic, fixed.placement.nnodes) == (3, None, False, "3")
    assert Placement(nodes=4, min_nodes=2).nnodes == "2:4"


@pytest.mark.parametrize("nodes, allowed", [
    ("2:x", "a count of nodes (1-4096) or MIN:MAX"),
    ("3:2", "MIN:MAX with 1 <= MIN <= MAX <= 4096"),
    ("0:2", "MIN:MAX with 1 <= MIN <= MAX <= 4096"),
    ("2:3:4", "a count of nodes (1-4096) or MIN:MAX"),
    ("2:5000", "MIN:MAX with 1 <= MIN <= MAX <= 4096"),
])
def test_a_bad_node_range_is_refused_naming_nodes(nodes, allowed):
    with pytest.raises(SpecError) as e:
        LaunchSpec(command=CMD, nodes=nodes, device="cpu")
    assert e.value.field == "nodes" and f"nodes={nodes!r}" in str(e.value) and allowed in str(e.value), str(e.value)


def test_what_an_elastic_job_cannot_have_yet_is_refused_before_anything_starts():
    with pytest.raises(SpecError) as e:
        LaunchSpec(command=CMD, nodes="1:2", device="cpu", backend="mpi", distribution="mpi")
    assert e.value.field == "nodes" and "a fixed count on backend 'mpi'" in str(e.value)
    assert "local" in str(e.value) and "ssh" in str(e.value)  # where elastic jobs run
    with pytest.raises(SpecError) as e:
        LaunchSpec(command=CMD, nodes="1:2", device="cpu", distribution="tensorflow")
    assert e.value.field == "distribution"


def test_the_cli_takes_nodes_min_max_and_refuses_a_bad_one_with_exit_2(tmp_path):
    env = dict(os.environ, DTRAIN_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "dtrain.cli", "launch", "--nodes", "2:3", "--device", "cpu",
                           "--dry-run", "--", *CMD], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--nnodes=2:3" in done.stdout and "--rdzv-backend=dtrain-c10d" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "dtrain.cli", "launch", "--nodes", "3:1", "--device", "cpu",
                          "--dry-run", "--", *CMD], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "nodes" in bad.stderr and "'3:1'" in bad.stderr, bad.stderr
    assert not os.path.exists(tmp_path / "runs")  # nothing created


def test_the_factory_param_takes_a_count_or_min_max():
    schema = {"type": NODES_TYPE, "minimum": 1, "maximum": 64, "pattern": NODES_PATTERN}
    assert [_check_one("nodes", v, schema) for v in (2, 2.0, "2", "2:4", " 2 : 4 ", "3:3")] == [2, 2, 2, "2:4", "2:4", 3]
    for bad in ("2:65", "x", "0", 2.5, "4:2"):
        with pytest.raises(SpecError) as e:
            _check_one("nodes", bad, schema)
        assert e.value.field == "nodes"


# -- what is rendered ---------------------------------------------------------------------------------

def test_the_elastic_agent_is_rendered_exactly():
    spec = LaunchSpec(command=[sys.executable, "-c", "pass"], nodes="2:4", procs_per_node=2, device="cpu",
                      rdzv_timeout=120, max_restarts=1, backend="local")
    spec.command = ["train.py", "--lr", "0.1"]  # a script on the nodes (the local backend checks paths here)
    argv = agent_argv(spec, python=PY, job_id="j1", rdzv=Elastic("10.0.0.1", 29400, "10.0.0.12"))
    assert argv == [
        PY, "-m", "dtrain.launch.node.torchrun_agent", "--nnodes=2:4", "--nproc-per-node=2",
        "--rdzv-backend=dtrain-c10d", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=j1",
        "--rdzv-conf=is_host=0,join_timeout=120,last_call_timeout=5,keep_alive_interval=3,keep_alive_max_attempt=3",
        "--local-addr=10.0.0.12", "--max-restarts=1", "--no-python",
        PY, "-m", "dtrain.launch.node.rank_entry", "train.py", "--lr", "0.1",
    ]


def test_ssh_runs_an_agent_on_every_host_spares_included_against_the_launchers_store(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.11\n127.0.0.12\n127.0.0.13 slots=4\n127.0.0.14\n")
    spec = LaunchSpec(command=["train.py"], nodes="2:3", backend="ssh", device="cpu", rdzv_port=29411,
                      backend_options={"hostfile": str(hostfile), "python": PY}, run_dir=str(tmp_path / "run"),
                      job_id="el1")
    request = SSHBackend().dryrun(prepare_job(spec, create=False))
    assert len(request.argvs) == 4  # 3 nodes at most, the 4th host a spare
    assert request.env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29411"}  # this host, on the route to them
    for i, argv in enumerate(request.argvs):
        remote = argv[-1]
        assert f"--local-addr=127.0.0.1{i + 1}" in remote and "--nnodes=2:3" in remote
        assert "--rdzv-endpoint=127.0.0.1:29411" in remote and "--node-rank" not in remote
    with pytest.raises(SpecError) as e:
        SSHBackend().dryrun(prepare_job(spec, create=False), detached=True)
    assert e.value.field == "deferrable"
    fixed = LaunchSpec(command=["train.py"], nodes=3, backend="ssh", device="cpu", rdzv_port=29411,
                       backend_options={"hostfile": str(hostfile), "python": PY}, job_id="el1")
    assert len(SSHBackend().dryrun(prepare_job(fixed, create=False)).argvs) == 3  # no spares without MIN:MAX


# -- rounds and membership (pure) ---------------------------------------------------------------------

def test_rounds_are_told_by_every_member_on_its_own_stream(tmp_path):
    lines: list[str] = []
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000020.pt").write_bytes(b"x")
    rounds = Rounds(str(tmp_path), 2, ["h0", "h1", "h2"], lines.append, KEY)
    body = "[dtrain-round] node={} round={} group_rank={} group_world_size={}"

    def line(stream, *fields):
        return f"[node{stream}] " + signed(body.format(*fields))

    assert rounds.feed(line(0, 0, 0, 0, 2)) and lines == []
    assert not rounds.feed(line(1, 2, 0, 1, 2))  # node 2's line on node 1's stream: output, not counted
    assert not rounds.feed(line(1, 1, 0, 2, 2))  # a rank outside the round
    assert not rounds.feed(line(1, 1, 0, 1, 9))  # more nodes than hosts
    assert not rounds.feed(line(1, 1, 0, 1, 2) + " extra")
    assert not rounds.feed("[node1 rank1] " + line(1, 1, 0, 1, 2)[8:])  # a rank's own output
    assert rounds.feed(line(1, 1, 0, 1, 2))
    assert rounds.to_list() == [{"round": 0, "nodes": [0, 1], "world_size": 4, "resume_step": 20}]
    assert lines == ["[dtrain] round 0: 2 node(s) [0 (h0), 1 (h1)], world size 4, from step 20"]
    assert rounds.feed(line(2, 2, 0, 0, 2))  # a late line for a round already told: consumed, no change
    assert len(rounds.to_list()) == 1


def test_round_lines_told_by_one_member_only_cannot_grow_the_launchers_memory(tmp_path):
    from dtrain.launch.core.elastic import MAX_OPEN_ROUNDS

    rounds = Rounds(str(tmp_path), 1, ["h0", "h1"], lambda line: None, KEY)
    for number in range(10_000):  # a node's lines (signed: its agent's), each a round no other member tells
        assert rounds.feed("[node0] " + signed(f"[dtrain-round] node=0 round={number} group_rank=0 group_world_size=2"))
    assert len(rounds._open) == MAX_OPEN_ROUNDS and rounds.to_list() == []
    assert rounds.feed("[node1] " + signed("[dtrain-round] node=1 round=9999 group_rank=1 group_world_size=2"))
    assert [r["round"] for r in rounds.to_list()] == [9999]  # the latest round is still told


def test_untagged_round_lines_name_their_node_as_slurms_one_output_file_has_them(tmp_path):
    lines: list[str] = []
    rounds = Rounds(str(tmp_path), 1, ["n0", "n1"], lines.append, KEY, tagged=False)
    assert not rounds.feed("[node0] " + signed("[dtrain-round] node=0 round=3 group_rank=0 group_world_size=2"))
    assert rounds.feed(signed("[dtrain-round] node=0 round=3 group_rank=1 group_world_size=2"))
    assert rounds.feed(signed("[dtrain-round] node=1 round=3 group_rank=0 group_world_size=2"))
    assert rounds.to_list() == [{"round": 3, "nodes": [1, 0], "world_size": 2, "resume_step": 0}]


def test_a_ranks_forged_round_lines_in_slurms_one_log_never_become_rounds(tmp_path):
    """Slurm's output file holds every rank's output beside the agents' lines: a rank's round lines
    (unsigned, signed with another key, or an agent's line altered) are shown as output, never counted."""
    lines: list[str] = []
    (tmp_path / "checkpoints").mkdir()
    rounds = Rounds(str(tmp_path), 4, ["n0", "n1"], lines.append, KEY, tagged=False)
    other = StoreKey("cd" * 32)
    forged = ["[dtrain-round] node=1 round=999999999 group_rank=0 group_world_size=1",
              "[dtrain-round] node=0 round=999999999 group_rank=0 group_world_size=1 mac=" + "0" * 64,
              "[dtrain-round] node=0 round=7 group_rank=0 group_world_size=1 mac="
              + other.round_mac("[dtrain-round] node=0 round=7 group_rank=0 group_world_size=1"),
              signed("[dtrain-round] node=0 round=1 group_rank=0 group_world_size=2").replace("round=1", "round=8")]
    for line in forged:
        for _ in range(1000):
            assert not rounds.feed(line)
    assert rounds.to_list() == [] and lines == [] and rounds._open == {}
    for node, rank in ((0, 0), (1, 1)):  # the agents' own lines among them still count
        assert rounds.feed(signed(f"[dtrain-round] node={node} round=1 group_rank={rank} group_world_size=2"))
    assert rounds.to_list() == [{"round": 1, "nodes": [0, 1], "world_size": 8, "resume_step": 0}]


def test_latest_step_never_follows_a_link(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "step-00000099.pt").write_bytes(b"x")
    os.symlink(tmp_path / "elsewhere", tmp_path / "checkpoints")
    assert latest_step(str(tmp_path)) == 0


@dataclass
class FakeProc:
    code: int | None = None

    def poll(self):
        return self.code


@dataclass
class FakeNode:
    index: int
    proc: FakeProc
    tail: tuple = ()
    reader: object = None


def lost(node: FakeNode, code: int):
    return LostNode(node.index, f"10.0.0.{node.index}", "gone", "crashed") if code == 255 else None


def test_membership_goes_on_while_min_nodes_run_and_gives_the_lost_verdict_below():
    said: list[str] = []
    nodes = {i: FakeNode(i, FakeProc()) for i in range(3)}
    members = Membership(2, said.append)
    assert members.status(members.scan(nodes, lost)) is None
    nodes[2].proc.code = 255
    assert members.status(members.scan(nodes, lost)) is None  # 2 left, MIN 2
    assert said == ["[dtrain] node 2 (10.0.0.2) lost: gone (crashed); 2 node(s) go on (at least 2): "
                    "the next round forms without it"]
    nodes[0].proc.code = 255
    status = members.status(members.scan(nodes, lost))
    assert (status.done, status.exit_code, status.failed_node, status.lost["node"]) == (True, 255, 0, 0)
    assert said[-1].endswith("1 node(s) left, fewer than 2: the job cannot go on")


def test_membership_success_failure_and_a_waiting_node_ending_after_success():
    members = Membership(1, lambda line: None)
    nodes = {i: FakeNode(i, FakeProc()) for i in range(2)}
    nodes[0].proc.code = 0
    assert members.status(members.scan(nodes, lost)) is None  # node 1 still runs
    nodes[1].proc.code = NO_ROUND_EXIT_CODE  # it waited for a next round when the rendezvous closed
    assert members.status(members.scan(nodes, lost)).ok
    crashed = Membership(1, lambda line: None)
    nodes = {i: FakeNode(i, FakeProc(), tail=(f"node {i}",)) for i in range(2)}
    nodes[1].proc.code = 0
    assert crashed.status(crashed.scan(nodes, lost)) is None
    nodes[0].proc.code = 134  # rank 0 crashed saving, after its peer finished
    status = crashed.status(crashed.scan(nodes, lost))
    assert (status.state, status.exit_code, status.failed_node) == ("FAILED", 134, 0)
    failing = Membership(1, lambda line: None)
    nodes = {i: FakeNode(i, FakeProc(), tail=("boom",)) for i in range(2)}
    nodes[1].proc.code = 3
    status = failing.status(failing.scan(nodes, lost))
    assert (status.state, status.exit_code, status.failed_node, list(status.tail)) == ("FAILED", 3, 1, ["boom"])


def test_a_failed_node_fails_the_job_though_the_idle_nodes_ended_first():
    """The node whose script failed closed the rendezvous; the nodes waiting for its next round end
    idle (their agents' NO_ROUND_EXIT_CODE), here seen before the failure: the job failed, on that node."""
    members = Membership(2, lambda line: None)
    nodes = {i: FakeNode(i, FakeProc(), tail=(f"node {i}",)) for i in range(3)}
    nodes[1].proc.code = nodes[2].proc.code = NO_ROUND_EXIT_CODE
    assert members.status(members.scan(nodes, lost)) is None  # node 0 still runs
    nodes[0].proc.code = 1
    status = members.status(members.scan(nodes, lost))
    assert (status.state, status.exit_code, status.failed_node, list(status.tail)) == ("FAILED", 1, 0, ["node 0"])
    succeeded = Membership(1, lambda line: None)
    nodes = {i: FakeNode(i, FakeProc()) for i in range(2)}
    nodes[1].proc.code = NO_ROUND_EXIT_CODE  # a spare, as the round's member succeeds
    assert succeeded.status(succeeded.scan(nodes, lost)) is None
    nodes[0].proc.code = 0
    assert succeeded.status(succeeded.scan(nodes, lost)).ok
    idle = Membership(1, lambda line: None)
    nodes = {0: FakeNode(0, FakeProc(NO_ROUND_EXIT_CODE))}
    status = idle.status(idle.scan(nodes, lost))
    assert (status.state, status.exit_code) == ("FAILED", 1)  # nobody ran: no success


# -- the agent: what a failure during a membership change is ----------------------------------------

@pytest.fixture
def rendezvous(tmp_path, monkeypatch):
    """``handler(i)``: node i's dtrain-c10d handler (nodes 2:3) at a real store process on loopback."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from dtrain.launch.node import elastic_rdzv

    secret = "3c" * 32
    monkeypatch.setattr(elastic_rdzv, "_job_key", StoreKey(secret))
    store = RendezvousStore()
    port = store.start("127.0.0.1", free_port("127.0.0.1"), secret)
    handlers = []

    def handler(index: int):
        monkeypatch.setenv("DTRAIN_NODE_INDEX", str(index))
        params = RendezvousParameters(elastic_rdzv.ELASTIC, f"127.0.0.1:{port}", "job-joins", 2, 3,
                                      local_addr="127.0.0.1", is_host=0, join_timeout=60, last_call_timeout=1)
        handlers.append(elastic_rdzv.elastic_handler(params))
        return handlers[-1]

    try:
        yield handler
    finally:
        if handlers:
            handlers[0].set_closed()  # a node still waiting in next_rendezvous ends
        for made in handlers:
            made._stop_heartbeats()
        store.stop()


class RecordingStore:
    """A store that passes every call on and records the method's name (TCPStore answers every
    request but ``set``)."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.store, name)


@pytest.mark.slow
def test_a_nodes_word_that_its_round_finished_is_in_the_store_when_it_returns(rendezvous):
    """TCPStore's set is not answered: a peer's agent reading right after could miss the value and take
    its workers' failure for the membership's. ``finished`` ends with an answered op on its connection."""
    node = rendezvous(0)
    node.round_, recorder = 0, RecordingStore(node._store)
    node._store = recorder
    node.finished()
    assert recorder.calls[0] == "set" and recorder.calls[-1] != "set"
    other = rendezvous(1)
    assert other.round_finished() is False  # a reader of another round (-1) finds nothing
    other.round_ = 0
    assert other.round_finished()


@pytest.mark.slow
def test_a_failure_while_a_node_waits_to_join_is_the_memberships_restart(rendezvous):
    """Node 2 waits to join a complete round of nodes 0 and 1. The agents restart their workers into
    the next round each when its monitor sees that, so node 1's restart can fail node 0's collective
    before node 0's agent saw node 2: node 0's agent takes that failure as the membership's (not counted
    against max_restarts), not as the script's."""
    first, second = rendezvous(0), rendezvous(1)
    formed = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in (first, second)]
    for thread in formed:
        thread.start()
    for thread in formed:
        thread.join(60)
    assert first.round_ == second.round_ >= 0 and len(first.members) == 2
    assert first.membership_change(within=1.0) is None  # nothing changes: a failure is the script's
    joiner = rendezvous(2)
    threading.Thread(target=lambda: pytest.raises(Exception, joiner.next_rendezvous), daemon=True).start()
    assert first.membership_change(within=15.0) == "joins"
    second.finished()  # node 1's workers succeeded in this round: a failure now is the script's
    assert first.round_finished() and first.membership_change(within=1.0) is None


# -- the store's process ------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_store_process_dies_with_the_launcher(tmp_path):
    code = ("import sys, time; from dtrain.launch.core.rdzv_store import RendezvousStore; "
            "from dtrain.launch.node.net import free_port; s = RendezvousStore(); "
            "print(s.start('127.0.0.1', free_port(), 'ab' * 32), flush=True); time.sleep(600)")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(launcher.stdout.readline())
        stores = psutil.Process(launcher.pid).children()
        assert len(stores) == 1 and "rdzv_store" in " ".join(stores[0].cmdline())
        import socket

        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # it serves
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert poll_until(lambda: not stores[0].is_running() or stores[0].status() == psutil.STATUS_ZOMBIE, 15, 0.1)
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


# -- the local backend: simulated nodes ---------------------------------------------------------------

ELASTIC_SCRIPT = script("elastic_train.py")


def start_local(tmp_path, *extra: str, nodes: str = "2:3", hang_timeout: float | None = None):
    spec = LaunchSpec(command=[sys.executable, ELASTIC_SCRIPT, str(tmp_path / "out"), "--until-file",
                               str(tmp_path / "stop"), *extra], nodes=nodes, device="cpu",
                      run_dir=str(tmp_path / "run"), stop_grace=2.0, hang_timeout=hang_timeout)
    lines: list[str] = []
    launcher = Launcher(spec, sink=lines.append)
    results: list[LaunchResult] = []
    thread = threading.Thread(target=lambda: results.append(launcher.run()), daemon=True)
    thread.start()
    return launcher, thread, results, lines


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_local_node_leaves_two_that_go_on_without_spending_a_restart(tmp_path):
    """max_restarts=0: the survivors restart into the next round, whether their workers failed first
    (their peer died: the round lost a member, not the script's failure) or the launcher's word that
    the node is lost came first (a membership change). The hang watch (hang_timeout 15 s) follows the
    round's world size: the lost node's rank, silent for good, is no hang. 15 s: the survivors' ranks
    start again in round 1 (torch imported anew) and must not look hung themselves on a loaded host."""
    launcher, thread, results, lines = start_local(tmp_path, hang_timeout=15)
    try:
        assert poll_until(lambda: any("[dtrain] round 0: 3 node(s)" in line for line in lines), 120, 0.2), lines[-30:]
        assert poll_until(lambda: latest_step(str(tmp_path / "run")) > 0, 60, 0.2), lines[-30:]
        victim = launcher.backend.supervisor.latest()[1]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        assert poll_until(lambda: any("[dtrain] round 1: 2 node(s)" in line for line in lines), 90, 0.2), lines[-30:]
        time.sleep(17)  # longer than hang_timeout: the lost rank is silent all along
        (tmp_path / "stop").touch()
        thread.join(90)
        assert not thread.is_alive(), lines[-30:]
    finally:
        launcher.terminate()
        thread.join(30)
    result = results[0]
    assert result.exit_code == 0 and not result.hang, lines[-30:]
    assert not any("no progress from rank(s)" in line for line in lines), lines[-30:]
    assert [sorted(r["nodes"]) for r in result.rounds] == [[0, 1, 2], [0, 2]]
    assert result.rounds[1]["resume_step"] > 0
    assert result.to_xcom()["rounds"] == result.rounds
    ends = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert {e["world_size"] for e in ends} == {2} and all(e["resumed_from"] > 0 for e in ends), ends
    assert launcher.spec.max_restarts == 0  # a restart counted against it would have failed the job


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_script_that_fails_on_every_node_still_fails_the_elastic_job(tmp_path):
    """No member is lost: the failure is the script's, counted against max_restarts (0): the job fails
    with the rank's exit code once the rendezvous has had the time to drop a member (it drops none)."""
    spec = LaunchSpec(command=[sys.executable, "-c", "import sys; sys.exit(7)"], nodes="1:2", device="cpu",
                      run_dir=str(tmp_path / "run"), stop_grace=2.0)
    lines: list[str] = []
    started = time.monotonic()
    result = Launcher(spec, sink=lines.append).run()
    assert result.exit_code == 7, lines[-30:]
    assert not any("not counted against max_restarts" in line for line in lines)
    assert time.monotonic() - started < 120
