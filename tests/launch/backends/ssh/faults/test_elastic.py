"""Elastic jobs (``nodes="MIN:MAX"``) on hosts with their own addresses (tests/netcluster.py), over the
ssh backend: a node lost mid-run (crashed, partitioned) with MIN nodes left does not end the job; the
survivors form the next round and go on from the last checkpoint at the smaller world size; a spare
host takes a lost node's place; a healed host rejoins; fewer than MIN ends the job with the lost-node
verdict. The rendezvous store runs with the launcher, so even node 0's host may go. Nothing of the
job is left on any host, nor the store on this one."""

from __future__ import annotations

import json
import os
import sys
import threading

import psutil
import pytest

from dtrain.launch.core.elastic import latest_step
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine import retry
from dtrain.launch.engine.launcher import Launcher
from tests.launch.conftest import script
from tests.remote_jobs import job_processes, needs_sshd, still_alive
from tests.services import _net_ssh_cluster
from tests.support import poll_until

pytestmark = [needs_sshd, pytest.mark.timeout(420)]

LOST_AFTER = 11.0  # near the least allowed (above 10 s): the tests wait for it
DIGITS = [sys.executable, "-m", "dtrain.training.reference.train_digits"]
ELASTIC_TRAIN = script("elastic_train.py")


@pytest.fixture
def three_hosts(tmp_path_factory):
    yield from _net_ssh_cluster(3, str(tmp_path_factory.mktemp("elastic3")))


@pytest.fixture
def four_hosts(tmp_path_factory):
    yield from _net_ssh_cluster(4, str(tmp_path_factory.mktemp("elastic4")))


class Run:
    """``Launcher(spec).run()`` of an elastic ssh job in a thread, with its lines."""

    def __init__(self, cluster, tmp_path, command, nodes: str = "2:3"):
        self.run_dir = str(tmp_path / "run")
        self.spec = LaunchSpec(command=command, nodes=nodes, procs_per_node=1, backend="ssh", device="cpu",
                               run_dir=self.run_dir, stop_grace=2.0,
                               backend_options={"hostfile": cluster.hostfile(1), **cluster.ssh_settings(),
                                                "lost_after": LOST_AFTER})
        self.lines: list[str] = []
        self.log_file = tmp_path / "launch.log"  # every line, for a failure's reader (the message has the last ones)
        self.launcher = Launcher(self.spec, sink=self.lines.append)
        self.results = []
        self.thread = threading.Thread(target=lambda: self.results.append(self.launcher.run()), daemon=True)
        self.thread.start()

    def log(self) -> str:
        self.log_file.write_text("\n".join(self.lines) + "\n")
        return f"(all lines: {self.log_file})\n" + "\n".join(self.lines[-60:])

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        assert poll_until(lambda: self.said(text), timeout, 0.2), \
            f"no {text!r} within {timeout:g} s:\n{self.log()}"

    def wait_for_checkpoint(self, past: int, timeout: float = 120) -> None:
        assert poll_until(lambda: latest_step(self.run_dir) > past, timeout, 0.2), self.log()

    def result(self, timeout: float):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the job did not end within {timeout:g} s:\n{self.log()}"
        return self.results[0]


def nothing_left(job_id: str) -> None:
    """No process of the job on any host, and no rendezvous store of this test's launcher here."""
    assert poll_until(lambda: still_alive(job_processes(job_id)) == [], 30, 0.2), still_alive(job_processes(job_id))
    assert still_alive(stores_here()) == []


def stores_here() -> list[psutil.Process]:
    """The rendezvous store processes among this test process's descendants."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "dtrain.launch.core.rdzv_store" in " ".join(proc.cmdline()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def round_nodes(result) -> list[list[int]]:
    return [sorted(r["nodes"]) for r in result.rounds]


def test_node_0s_host_crashes_and_the_job_finishes_on_two_with_a_correct_model(three_hosts, tmp_path):
    """3 hosts, nodes=2:3, the demo's model: host 0 (node 0, rank 0 of the first round) crashes after
    the first checkpoint; hosts 1 and 2 form round 1 at world size 2, resume from that checkpoint and
    finish with exit 0 and the demo's accuracy."""
    net = three_hosts.net
    run = Run(three_hosts, tmp_path, DIGITS + ["--epochs", "8", "--step-sleep", "0.05", "--checkpoint-every", "10"])
    run.wait_for("[dtrain] round 0: 3 node(s)", 120)
    run.wait_for_checkpoint(past=0)
    net.crash(0)
    result = run.result(240)
    log = run.log()
    assert result.exit_code == 0, log
    assert run.said(f"[dtrain] node 0 ({net.hosts[0].address}) lost: gone"), log
    assert round_nodes(result) == [[0, 1, 2], [1, 2]], result.rounds
    assert [r["world_size"] for r in result.rounds] == [3, 2]
    assert result.rounds[1]["resume_step"] >= 10, result.rounds  # not from scratch
    assert result.metrics["world_size"] == 2 and result.metrics["test_accuracy"] >= 0.95, result.metrics
    assert run.said("resumed from checkpoint at step"), log
    nothing_left(result.job_id)


def test_a_partitioned_host_is_left_behind_and_rejoins_when_healed(three_hosts, tmp_path):
    """Host 2 cut off: its peers hang in their all-reduce until the rendezvous drops it, then go on as
    round 1 on two nodes; its own lease stops what it ran. Healed, it answers again and rejoins: round 2
    has all three, and the job ends at world size 3."""
    net = three_hosts.net
    until = tmp_path / "stop"
    run = Run(three_hosts, tmp_path, [sys.executable, ELASTIC_TRAIN, str(tmp_path / "out"), "--until-file", str(until)])
    run.wait_for("[dtrain] round 0: 3 node(s)", 120)
    run.wait_for_checkpoint(past=0)
    net.partition(2)
    try:
        run.wait_for("[dtrain] round 1: 2 node(s)", 90)
        run.wait_for(f"[dtrain] node 2 ({net.hosts[2].address}) lost: unreachable", 60)
    finally:
        net.heal(2)
    run.wait_for(f"[dtrain] node 2 ({net.hosts[2].address}) answers again", 90)
    run.wait_for("[dtrain] round 2: 3 node(s)", 90)
    until.touch()
    result = run.result(120)
    assert result.exit_code == 0, run.log()
    assert round_nodes(result) == [[0, 1, 2], [0, 1], [0, 1, 2]], result.rounds
    assert result.rounds[2]["resume_step"] >= result.rounds[1]["resume_step"] > 0, result.rounds
    ends = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(3)]
    assert {e["world_size"] for e in ends} == {3} and len({e["step"] for e in ends}) == 1, ends
    nothing_left(result.job_id)


def test_a_spare_host_replaces_a_frozen_one_and_fewer_than_min_ends_the_job(four_hosts, tmp_path):
    """4 hosts for nodes=2:3: one is a spare. A member's host freezes: the rendezvous drops it once its
    keep-alive lapses, and the spare takes its place (round 1 has three nodes again); the launcher names
    it frozen once its ssh keepalive gives up. Then two more hosts crash: one node is left, fewer than
    MIN: the job ends with the lost-node verdict, which the retry policy retries. Thawed, the frozen host
    finds its lease long lapsed and stops what it ran: nothing is left anywhere."""
    net = four_hosts.net
    run = Run(four_hosts, tmp_path, [sys.executable, ELASTIC_TRAIN, str(tmp_path / "out"),
                                     "--until-file", str(tmp_path / "never")])
    run.wait_for("[dtrain] round 0: 3 node(s)", 120)
    first = sorted(run.launcher.backend.rounds.to_list()[0]["nodes"])
    spare, victim = ({0, 1, 2, 3} - set(first)).pop(), first[1]
    run.wait_for_checkpoint(past=0)
    net.freeze(victim)
    try:
        run.wait_for("[dtrain] round 1: 3 node(s)", 90)
        survivors = sorted(set(first) - {victim} | {spare})
        assert sorted(run.launcher.backend.rounds.to_list()[1]["nodes"]) == survivors
        run.wait_for(f"[dtrain] node {victim} ({net.hosts[victim].address}) lost: frozen", 60)
        for index in survivors[:2]:
            net.crash(index)
        result = run.result(120)
    finally:
        net.thaw(victim)
    assert result.exit_code == 255 and result.lost, run.log()
    assert result.lost["node"] in survivors[:2] and result.lost["fault"] == "gone", result.lost
    assert run.said("fewer than 2: the job cannot go on"), run.log()
    with pytest.raises(Exception) as raised:
        result.raise_for_status()
    assert retry.classify(raised.value).action == retry.RETRY
    nothing_left(result.job_id)
