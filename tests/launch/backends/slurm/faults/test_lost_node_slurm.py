"""A node lost mid-training on a Slurm cluster whose nodes are hosts with their own addresses
(tests/netcluster.py, a cluster of the test's own): partitioned (its link down), frozen (every process
on it stopped, slurmd too), crashed (every process on it killed, slurmd too) or left without its slurmd
(only slurmd killed).

Slurm's own answer comes after SlurmdTimeout (minutes on a real cluster), and it could not stop a cut-off
node's ranks anyway. Here each ends the launch with the lost-node verdict (exit 255, the node, its
address and the fault class; the retry policy's lost-node class), the reachable node cleaned by the
cancel, and the lost node's ranks gone: a partitioned node fences itself while still cut off (its lease
could not reach its peer, the other node's slurmd), a frozen one as soon as it thaws. The partition and the freeze are
followed by the launcher (``dtrain launch``, and the operator's durable mode: the same poll), the crash
by the deferred mode's trigger (the async poll)."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.node.lease import fenced_name, read_fence
from dtrain.rundir import LEASE, RunDir
from tests.launch.backends.ssh.faults.test_lost_node import assert_lost, finish, freeze_and_thaw, launch, on_host, partitioned
from tests.launch.backends.ssh.faults.test_lost_node_detached import assert_resumed_lost, first_event, submit_deferred
from tests.remote_jobs import train_command
from tests.support import poll_until

pytestmark = pytest.mark.timeout(300)

#: lost_after for the faults whose detection time is not the point (the default, 30 s, for a partition)
SHORT_LOST_AFTER = 12.0


def spec_for(tmp_path, **options) -> LaunchSpec:
    return LaunchSpec(command=train_command("--steps", "2", "--hang"), nodes=2, procs_per_node=1, backend="slurm",
                      device="cpu", run_dir=str(tmp_path / "run"), stop_grace=2.0,
                      backend_options={"poll_interval": 0.5, **options})


def start(tmp_path, **options):
    return launch(spec_for(tmp_path, **options))


def test_a_partitioned_node_fences_itself_while_still_cut_off_and_is_named(faulty_slurm, tmp_path, capsys):
    """Default settings: the node's lease (it must reach its peer, the other node's slurmd) lapses after 30 s."""
    net = faulty_slurm.net
    launcher, thread, results, lines = start(tmp_path)
    job_id = launcher.job.job_id
    with partitioned(net, job_id, (thread, results, lines), 120, capsys, "slurm, partitioned node") as result:
        # still partitioned, and its ranks are gone: it fenced itself when its lease lapsed
        assert on_host(net, 1, job_id) == []
        reason = RunDir(result.run_dir).read(LEASE, job_id, fenced_name(1), limit=4096)
        assert reason is not None and b"could not reach its peer" in reason, reason


def test_a_frozen_node_is_named_and_fences_itself_when_it_thaws(faulty_slurm, tmp_path, capsys):
    launcher, thread, results, lines = start(tmp_path, lost_after=SHORT_LOST_AFTER)
    freeze_and_thaw(faulty_slurm.net, launcher.job.job_id, (thread, results, lines), 120, capsys, "slurm, frozen node")


def test_deferred_a_crashed_node_is_named_gone(faulty_slurm, tmp_path, capsys):
    """The trigger's watch (async poll); the task's resume raises the lost-node verdict and cancels the job."""
    net = faulty_slurm.net
    backend, handle = submit_deferred("slurm", spec_for(tmp_path, lost_after=SHORT_LOST_AFTER))
    try:
        net.crash(1)
        crashed = time.monotonic()
        event = first_event(handle)
        with capsys.disabled():
            print(f"\n[fault] slurm, crashed node, deferred: the trigger's event {time.monotonic() - crashed:.1f} s "
                  "after the fault")
        assert_resumed_lost(event, net, handle, "gone")
    finally:
        backend.cancel(handle)
    assert on_host(net, 1, handle.job_id) == []


def test_a_node_whose_slurmd_was_killed_fences_itself_and_is_named_gone(faulty_slurm, tmp_path, capsys):
    """Its host lives on and its ranks train on (slurmstepd does not need slurmd), but nothing could stop
    them any more: the node's lease checks its own slurmd too, and fences the node after lost_after."""
    net = faulty_slurm.net
    launcher, thread, results, lines = start(tmp_path, lost_after=SHORT_LOST_AFTER)
    job_id = launcher.job.job_id
    commands = [(p, p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]  # None: gone, a zombie
    slurmd = [p for p, argv in commands if argv[:1] and os.path.basename(argv[0]) == "slurmd" and "node2" in argv
              and p.pid in net.hosts[1].pids()]
    assert len(slurmd) == 1, slurmd
    slurmd[0].kill()
    result = finish(thread, results, lines, 120, capsys, "slurm, slurmd-killed node")
    assert_lost(result, net, lines, "gone")
    # Node 0, whose peer is node 1's slurmd, fences itself at about the same moment: the verdict may come
    # before node 1's own fence record (seen in a clean-clone run), so that record is read itself.
    reason = poll_until(lambda: read_fence(RunDir(result.run_dir), job_id, 1), SHORT_LOST_AFTER + 10, 0.2)
    assert reason is not None and "this node's own daemon at " in reason, reason
    # fenced: its ranks are gone within the fence's grace (2 s)
    assert poll_until(lambda: on_host(net, 1, job_id) == [], 10, 0.2), on_host(net, 1, job_id)
