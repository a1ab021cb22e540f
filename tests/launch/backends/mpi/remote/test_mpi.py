"""distribution=mpi with real OpenMPI: DDP over gloo on 2 sshd hosts x 2 ranks (hosts with their own
addresses: the namespace cluster, tests/netcluster.py), the
OMPI_COMM_WORLD_* variables mapped to the contract, user options passed through; and a
failing rank ends the job everywhere with its exit code."""

from __future__ import annotations

import time

import psutil
import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from tests.remote_jobs import (job_processes, needs_mpirun, needs_sshd, reports, run_within, still_alive,
                                   train_command, wait_for)

pytestmark = [needs_sshd, needs_mpirun, pytest.mark.timeout(240)]


def orteds_since(t0: float, cluster) -> list[int]:
    """OpenMPI daemons on ``cluster``'s hosts started since ``t0`` that still run (they carry no job id
    to look for; the hosts' namespaces tell them from those of a parallel test's cluster)."""
    hosts = set().union(*(host.pids() for host in cluster.net.hosts))
    out = []
    for proc in psutil.process_iter(["name", "create_time"]):
        if proc.info["name"] == "orted" and proc.info["create_time"] >= t0 - 1 and proc.pid in hosts:
            out.append(proc.pid)
    return out


def mpi_spec(cluster, tmp_path, command, **kw) -> LaunchSpec:
    return LaunchSpec(command=command, nodes=2, procs_per_node=2, backend="ssh", distribution="mpi", device="cpu",
                      backend_options={"hostfile": cluster.hostfile(2), **cluster.ssh_settings()},
                      run_dir=str(tmp_path / "run"),
                      mpi_options=["--oversubscribe", "-x TEST_MPI_OPTION=passed-through"], **kw)


def test_mpirun_trains_ddp_on_two_hosts_with_the_env_mapped(net_cluster, tmp_path):
    t0 = time.time()
    lines: list[str] = []
    launcher = Launcher(mpi_spec(net_cluster, tmp_path, train_command("--steps", "6")), sink=lines.append)
    result = run_within(launcher, lines)
    assert result.exit_code == 0, "\n".join(lines[-40:])
    assert any(line.startswith("[dtrain] mpirun: mpirun --hostfile") for line in lines)
    got = reports(result.run_dir)
    assert sorted(got) == [0, 1, 2, 3]
    for rank, rep in got.items():
        # rank_entry mapped OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE; NODE_RANK = rank // local size.
        assert rep["env"] == {"MASTER_ADDR": net_cluster.net.hosts[0].address, "MASTER_PORT": rep["env"]["MASTER_PORT"],
                              "WORLD_SIZE": "4", "RANK": str(rank), "LOCAL_RANK": str(rank % 2),
                              "LOCAL_WORLD_SIZE": "2", "NODE_RANK": str(rank // 2),
                              "GLOO_SOCKET_IFNAME": net_cluster.net.hosts[rank // 2].interface}
        assert rep["env"]["MASTER_PORT"].isdigit()
        assert rep["mpi_option"] == "passed-through"
    grads = [got[r]["grad_sums"] for r in range(4)]
    assert all(g == pytest.approx(grads[0], rel=1e-9, abs=1e-12) for g in grads)
    assert got[0]["losses"][-1] < got[0]["losses"][0] * 0.9
    assert any(line.startswith("[node1 rank3] rank 3 done") for line in lines)
    assert still_alive(job_processes(result.job_id)) == []
    assert wait_for(lambda: orteds_since(t0, net_cluster) == [] and net_cluster.session_pids() == set(), timeout=10)


def test_mpi_failing_rank_stops_every_rank_with_its_exit_code(net_cluster, tmp_path):
    t0 = time.time()
    lines: list[str] = []
    spec = mpi_spec(net_cluster, tmp_path, train_command("--steps", "50", "--fail-rank", "2", "--hang"))
    result = run_within(Launcher(spec, sink=lines.append), lines)
    assert result.exit_code == 3 and result.failed_rank == 2, "\n".join(lines[-40:])
    assert result.failed_node == 1
    assert still_alive(job_processes(result.job_id)) == []
    assert wait_for(lambda: orteds_since(t0, net_cluster) == [] and net_cluster.session_pids() == set(), timeout=10)


def test_dtrain_launch_mpi_on_this_host_passes_options_and_exit_status(tmp_path):
    """`dtrain launch --distribution mpi --mpi-option ...` on the local backend: ranks mapped,
    options passed through, and a failing rank's exit status is the CLI's."""
    import os
    import subprocess
    import sys

    dtrain = os.path.join(os.path.dirname(sys.executable), "dtrain")

    def launch(run_dir, *script_args):
        return subprocess.run([dtrain, "launch", "--distribution", "mpi", "--procs-per-node", "2", "--device", "cpu",
                               "--run-dir", str(run_dir), "--mpi-option=--oversubscribe",
                               "--mpi-option=-x TEST_MPI_OPTION=from-cli", "--",
                               *train_command("--start-only", *script_args)],
                              capture_output=True, text=True, timeout=120)

    ok = launch(tmp_path / "ok")
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    got = reports(str(tmp_path / "ok"))
    assert [got[r]["env"]["RANK"] for r in (0, 1)] == ["0", "1"]
    assert [got[r]["env"]["LOCAL_RANK"] for r in (0, 1)] == ["0", "1"]
    assert {got[r]["env"]["NODE_RANK"] for r in (0, 1)} == {"0"}
    assert {got[r]["mpi_option"] for r in (0, 1)} == {"from-cli"}
    failed = launch(tmp_path / "failed", "--fail-rank", "1")
    assert failed.returncode == 3, failed.stdout[-2000:] + failed.stderr[-2000:]
    refused = subprocess.run([dtrain, "launch", "--distribution", "mpi", "--mpi-option=--mca plm_rsh_agent /bin/sh",
                              "--", *train_command("--start-only")], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "plm_rsh_agent" in refused.stderr


def test_a_run_dir_with_blanks_is_refused_before_anything_is_created(net_cluster, tmp_path):
    from dtrain.errors import SpecError

    run_dir = tmp_path / "with blank"
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=["true"], nodes=2, procs_per_node=2, backend="ssh", distribution="mpi", device="cpu",
                   backend_options={"hostfile": net_cluster.hostfile(2), **net_cluster.ssh_settings()},
                   run_dir=str(run_dir))
    assert err.value.field == "run_dir" and not run_dir.exists()
