"""A node lost mid-training under mpirun over ssh, on hosts with their own addresses (tests/netcluster.py,
a cluster of the test's own): partitioned (its link down), frozen (every process on it stopped) or crashed
(every process on it killed).

mpirun's nodes run no agent of ours: each node's local rank 0 holds the node's lease (its peer the next
node's sshd) and beats in the run directory; the launcher reads the leases and probes the nodes' sshd on a
sign. Each fault ends the launch with the lost-node verdict (exit 255, the node, its address and the fault
class; the retry policy's lost-node class), the reachable node cleaned at once, and the lost node's ranks
gone: a partitioned node fences itself while still cut off, a frozen one as soon as it thaws."""

from __future__ import annotations

import psutil
import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.node.lease import read_fence
from dtrain.rundir import RunDir
from tests.launch.backends.ssh.faults.test_lost_node import assert_lost, finish, freeze_and_thaw, launch, on_host, partitioned
from tests.remote_jobs import needs_mpirun, needs_sshd, train_command
from tests.support import poll_until

pytestmark = [needs_sshd, needs_mpirun, pytest.mark.timeout(300)]

#: lost_after for the faults whose detection time is not the point (the default, 30 s, for a partition)
SHORT_LOST_AFTER = 12.0


def start(cluster, tmp_path, **ssh):
    return launch(LaunchSpec(command=train_command("--steps", "2", "--hang"), nodes=2, procs_per_node=1, backend="ssh",
                             distribution="mpi", device="cpu", run_dir=str(tmp_path / "run"), stop_grace=2.0,
                             backend_options={"hostfile": cluster.hostfile(1), **cluster.ssh_settings(), **ssh}))


def orteds_on(net, index: int) -> list[int]:
    """OpenMPI's daemons on host ``index`` (they carry no job id)."""
    pids = net.hosts[index].pids()
    return [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "orted" and p.pid in pids]


def test_a_partitioned_node_is_named_and_fences_itself_while_still_cut_off(faulty_cluster, tmp_path, capsys):
    """Default settings: the node's lease (it must reach its peer, the other node's sshd) lapses after 30 s."""
    net = faulty_cluster.net
    launcher, thread, results, lines = start(faulty_cluster, tmp_path)
    job_id = launcher.job.job_id
    with partitioned(net, job_id, (thread, results, lines), 120, capsys, "mpi, partitioned node") as result:
        # still partitioned: the node stops its own ranks when its lease lapses, within the fence grace
        assert poll_until(lambda: on_host(net, 1, job_id) == [], 60, 0.5), on_host(net, 1, job_id)
        assert "lease of 30 s lapsed" in (read_fence(RunDir(result.run_dir), job_id, 1) or "")
    # healed: its OpenMPI daemon, whose mpirun is gone, ends once it can tell
    assert poll_until(lambda: orteds_on(net, 1) == [], 60, 0.5), orteds_on(net, 1)


def test_a_frozen_node_is_named_and_fences_itself_when_it_thaws(faulty_cluster, tmp_path, capsys):
    launcher, thread, results, lines = start(faulty_cluster, tmp_path, lost_after=SHORT_LOST_AFTER)
    freeze_and_thaw(faulty_cluster.net, launcher.job.job_id, (thread, results, lines), 90, capsys, "mpi, frozen node")


def test_a_crashed_node_is_named_gone(faulty_cluster, tmp_path, capsys):
    net = faulty_cluster.net
    launcher, thread, results, lines = start(faulty_cluster, tmp_path, lost_after=SHORT_LOST_AFTER)
    job_id = launcher.job.job_id
    net.crash(1)
    result = finish(thread, results, lines, 60, capsys, "mpi, crashed node")
    assert_lost(result, net, lines, "gone")
    assert on_host(net, 1, job_id) == []
