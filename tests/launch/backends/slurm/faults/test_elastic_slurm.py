"""Elastic jobs (``nodes="MIN:MAX"``) on a real three-node Slurm cluster (slurmd on hosts with their own
addresses, tests/netcluster.py): the allocation survives a node's crash (``--no-kill``) and the survivors
finish at world size 2 with the demo's accuracy; a node cut off is left behind (it fences itself); fewer
than MIN left ends the job with the lost-node verdict. The node that runs the batch script (node 0) is not the one crashed: its loss ends a Slurm job.
Nothing of the job is left on any host, nor in Slurm's queue."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from dtrain.launch.core.elastic import latest_step
from dtrain.launch.engine import retry
from dtrain.launch.engine.launcher import Launcher
from dtrain.launch.node.lease import read_fence
from dtrain.rundir import RunDir
from tests.launch.backends.ssh.faults.test_elastic import DIGITS, ELASTIC_TRAIN, nothing_left
from tests.services import _net_slurm_cluster
from tests.slurm_cluster import queue
from tests.launch.backends.slurm.conftest import cpu_spec
from tests.support import poll_until

pytestmark = [pytest.mark.timeout(420)]


@pytest.fixture
def three_slurm_nodes():
    yield from _net_slurm_cluster(3)


def launch(spec):
    lines: list[str] = []
    launcher = Launcher(spec, sink=lines.append)
    results = []
    thread = threading.Thread(target=lambda: results.append(launcher.run()), daemon=True)
    thread.start()
    return launcher, thread, results, lines


def nothing_running(cluster) -> bool:
    """No job of the cluster runs or waits: one that lost a node stays COMPLETING until Slurm declares the
    node down (SlurmdTimeout, 60 s here); its processes on the other nodes are gone by then."""
    out = cluster.run(["squeue", "-h", "-o", "%T"]).stdout.split()
    return all(state == "COMPLETING" for state in out)


def said(lines, text: str) -> bool:
    return any(text in line for line in lines)


def test_a_crashed_node_leaves_a_slurm_job_that_finishes_on_two_with_a_correct_model(three_slurm_nodes, tmp_path):
    net, run_dir = three_slurm_nodes.net, str(tmp_path / "run")
    spec = cpu_spec(DIGITS + ["--epochs", "8", "--step-sleep", "0.05", "--checkpoint-every", "10"], nodes="2:3",
                    procs_per_node=1, run_dir=run_dir, stop_grace=2.0, backend_options={"lost_after": 11})
    launcher, thread, results, lines = launch(spec)
    assert poll_until(lambda: said(lines, "[dtrain] round 0: 3 node(s)"), 180, 0.2), "\n".join(lines[-40:])
    assert poll_until(lambda: latest_step(run_dir) > 0, 120, 0.2), "\n".join(lines[-40:])
    net.crash(2)
    thread.join(240)
    assert not thread.is_alive(), "\n".join(lines[-40:])
    result = results[0]
    assert result.exit_code == 0, "\n".join(lines[-60:])
    assert said(lines, f"[dtrain] node 2 ({net.hosts[2].address}) lost: gone"), "\n".join(lines[-60:])
    assert [sorted(r["nodes"]) for r in result.rounds] == [[0, 1, 2], [0, 1]], result.rounds
    assert result.rounds[1]["resume_step"] >= 10, result.rounds
    assert result.metrics["world_size"] == 2 and result.metrics["test_accuracy"] >= 0.95, result.metrics
    assert poll_until(lambda: nothing_running(three_slurm_nodes), 30, 0.5), queue(three_slurm_nodes)
    nothing_left(result.job_id)


def test_a_cut_off_slurm_node_is_left_behind_then_fewer_than_min_end_the_job(three_slurm_nodes, tmp_path):
    """Node 2's host cut off: its peers hang in their all-reduce until the rendezvous drops it, then go on
    as round 1 on two nodes; it fences itself while still cut off (its lease: it cannot reach the
    launcher's store), and the launcher names it unreachable. Then node 1's host crashes: one node is
    left, fewer than MIN: the job ends with the lost-node verdict, which the retry policy retries."""
    net, run_dir = three_slurm_nodes.net, str(tmp_path / "run")
    spec = cpu_spec([sys.executable, ELASTIC_TRAIN, str(tmp_path / "out"), "--until-file", str(tmp_path / "never")],
                    nodes="2:3", procs_per_node=1, run_dir=run_dir, stop_grace=2.0, backend_options={"lost_after": 11})
    launcher, thread, results, lines = launch(spec)
    assert poll_until(lambda: said(lines, "[dtrain] round 0: 3 node(s)"), 180, 0.2), "\n".join(lines[-40:])
    assert poll_until(lambda: latest_step(run_dir) > 0, 120, 0.2), "\n".join(lines[-40:])
    job_id = launcher.job.job_id
    net.partition(2)
    try:
        assert poll_until(lambda: said(lines, "[dtrain] round 1: 2 node(s)"), 90, 0.2), "\n".join(lines[-40:])
        assert poll_until(lambda: said(lines, f"[dtrain] node 2 ({net.hosts[2].address}) lost: unreachable"), 60,
                          0.2), "\n".join(lines[-40:])
        fence = read_fence(RunDir(run_dir), job_id, 2)
        assert fence is not None and "could not reach its peer" in fence, fence
        net.crash(1)
        thread.join(180)
    finally:
        net.heal(2)
    assert not thread.is_alive(), "\n".join(lines[-40:])
    result = results[0]
    assert result.exit_code == 255 and (result.lost["node"], result.lost["fault"]) == (1, "gone"), \
        "\n".join(lines[-60:])
    assert said(lines, "fewer than 2: the job cannot go on")
    with pytest.raises(Exception) as raised:
        result.raise_for_status()
    assert retry.classify(raised.value).action == retry.RETRY
    assert poll_until(lambda: nothing_running(three_slurm_nodes), 60, 0.5), queue(three_slurm_nodes)
    nothing_left(result.job_id)


FORGE_ROUNDS = os.path.join(os.path.dirname(__file__), "scripts", "forge_rounds.py")


def test_a_ranks_forged_round_lines_in_the_job_log_never_become_rounds(three_slurm_nodes, tmp_path):
    """Every rank appends round lines for a round 999999999 (unsigned, and with a made-up MAC) to the
    job's Slurm output file, the one log the launcher parses: they are shown as output, and the job's
    rounds (log, XCom) are the agents' only."""
    run_dir = str(tmp_path / "run")
    stop = tmp_path / "stop"
    spec = cpu_spec([sys.executable, FORGE_ROUNDS, ELASTIC_TRAIN, str(tmp_path / "out"), "--until-file", str(stop)],
                    nodes="1:2", procs_per_node=1, run_dir=run_dir, stop_grace=2.0, backend_options={"lost_after": 11})
    launcher, thread, results, lines = launch(spec)
    try:
        assert poll_until(lambda: said(lines, "[dtrain] round 0: 2 node(s)"), 180, 0.2), "\n".join(lines[-40:])
        assert poll_until(lambda: said(lines, "round=999999999"), 60, 0.2), "\n".join(lines[-40:])
        assert poll_until(lambda: latest_step(run_dir) > 0, 120, 0.2), "\n".join(lines[-40:])
    finally:
        stop.touch()
    thread.join(240)
    assert not thread.is_alive(), "\n".join(lines[-40:])
    result = results[0]
    assert result.exit_code == 0, "\n".join(lines[-60:])
    assert [sorted(r["nodes"]) for r in result.rounds] == [[0, 1]], result.rounds
    assert result.to_xcom()["rounds"] == result.rounds
    assert not said(lines, "[dtrain] round 999999999"), "\n".join(lines[-60:])
    assert poll_until(lambda: nothing_running(three_slurm_nodes), 30, 0.5), queue(three_slurm_nodes)
    nothing_left(result.job_id)
