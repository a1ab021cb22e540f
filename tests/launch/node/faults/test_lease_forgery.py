"""Lease records forged by a rank of a real job, on hosts with their own addresses (tests/netcluster.py):
the healthy node is never declared lost, the job finishes, and the log names each forged record.

Any rank can write the run directory, where each node's lease holder beats and records a fence
(dtrain.launch.node.lease). On Slurm the holder signs them with the job's lease key, which the ranks'
environment does not carry, and a beat's age is its file's ctime: a rank's back-dated beat (``os.utime``,
or a stale beat of its own) made the launcher probe node 1's slurmd, whose answer then read as a frozen
node; its fence record, a node cut off. Under mpirun the holder is a thread of a rank, so its records are
hints: a fence record that every node's sshd contradicts makes the node suspect, not lost."""

from __future__ import annotations

import os
import sys

import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from dtrain.launch.node.lease import beat_name, fenced_name
from dtrain.rundir import LEASE
from tests.remote_jobs import needs_mpirun, needs_sshd

pytestmark = pytest.mark.timeout(300)

FORGE = os.path.join(os.path.dirname(__file__), "scripts", "forge_lease.py")
#: how long rank 0 forges: longer than a stale beat (15 s) and a few of the launcher's polls
FORGING_S = "20"


def run_forging(spec: LaunchSpec):
    lines: list[str] = []
    result = Launcher(spec, sink=lines.append).run()
    return result, lines


def assert_finished_and_named(result, lines, record: str):
    log = "\n".join(lines[-60:])
    assert result.exit_code == 0 and not result.lost, log
    assert not any(" lost: " in line for line in lines), log
    assert any(record in line for line in lines), log


@pytest.mark.parametrize("forged", ["beat", "fence"])
def test_slurm_a_ranks_forged_lease_record_loses_no_node(slurm, tmp_path, forged):
    spec = LaunchSpec(command=[sys.executable, FORGE, forged, FORGING_S], nodes=2, procs_per_node=1, backend="slurm",
                      device="cpu", run_dir=str(tmp_path / "run"), stop_grace=2.0,
                      backend_options={"poll_interval": 0.5, "lost_after": 12})
    result, lines = run_forging(spec)
    name = beat_name(1) if forged == "beat" else fenced_name(1)
    assert_finished_and_named(result, lines, f"[dtrain] node 1: refused the {forged} record {LEASE}/{result.job_id}/{name}: "
                                             "not signed (no MAC)")


@needs_sshd
@needs_mpirun
def test_mpi_a_ranks_forged_fence_record_makes_a_suspect_not_a_lost_node(faulty_cluster, tmp_path):
    spec = LaunchSpec(command=[sys.executable, FORGE, "fence", FORGING_S], nodes=2, procs_per_node=1, backend="ssh",
                      distribution="mpi", device="cpu", run_dir=str(tmp_path / "run"), stop_grace=2.0,
                      backend_options={"hostfile": faulty_cluster.hostfile(1), **faulty_cluster.ssh_settings(),
                                       "lost_after": 12})
    result, lines = run_forging(spec)
    assert_finished_and_named(result, lines, f"[dtrain] node 1 ({faulty_cluster.net.hosts[1].address}) suspect: an "
                                             "unsigned fence record says it fenced itself (this node could not reach "
                                             "its peer (forged by rank 0))")
