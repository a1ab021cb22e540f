"""The Slurm backend against a real two-node cluster (munged, slurmctld, two slurmd; see cluster.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from dtrain.launch.engine.launcher import Launcher

from tests.support import poll_until

from ..conftest import DDP_REPORT, REPO, alive, cpu_spec, queue, wait_for


def describe(pids) -> list[str]:
    """Each process as "pid ppid status: command line", for a failure message."""
    import psutil

    out = []
    for pid in sorted(pids):
        try:
            proc = psutil.Process(pid)
            out.append(f"{pid} {proc.ppid()} {proc.status()}: {' '.join(proc.cmdline())[:200]}")
        except psutil.NoSuchProcess:
            continue
    return out


HOSTILE_ARGS = ["$(touch {p})", "'; touch {p}; echo '", "`touch {p}`", "a b\n c"]


def reports(path) -> list[dict]:
    return [json.load(open(os.path.join(path, name))) for name in sorted(os.listdir(path))]


def test_ddp_two_nodes_by_two_trains_and_node_rank_is_slurm_nodeid(slurm, tmp_path):
    pwned = tmp_path / "pwned"
    hostile = [a.format(p=pwned) for a in HOSTILE_ARGS]
    spec = cpu_spec(["python", DDP_REPORT, str(tmp_path / "rep"), *hostile], run_dir=str(tmp_path / "run"),
                    env={"HOSTILE": hostile[0]}, backend_options={"poll_interval": 0.3})
    lines: list[str] = []
    result = Launcher(spec, sink=lines.append).run()
    assert result.exit_code == 0, "\n".join(lines)
    ranks = reports(tmp_path / "rep")
    assert sorted(int(r["RANK"]) for r in ranks) == [0, 1, 2, 3]
    assert {r["WORLD_SIZE"] for r in ranks} == {"4"}
    for r in ranks:
        assert r["NODE_RANK"] == r["SLURM_NODEID"] == r["GROUP_RANK"]
        assert int(r["NODE_RANK"]) == int(r["RANK"]) // 2 and r["LOCAL_WORLD_SIZE"] == "2"
        # node1's NodeAddr (its host's own address): the name itself does not resolve
        assert r["MASTER_ADDR"] == slurm.node_address("node1") != "127.0.0.1"
        # No GLOO_SOCKET_IFNAME was given: each node took the interface that reaches node1 (eth1 on
        # node1, whose eth0 is a decoy listed first), and gloo connected across the hosts.
        assert r["GLOO_SOCKET_IFNAME"] == slurm.host(r["SLURMD_NODENAME"]).interface, r
        assert r["argv"] == hostile and r["HOSTILE"] == hostile[0]  # verbatim, and inert
        assert r["last_loss"] < r["first_loss"] / 10  # it trained
    assert len({(r["weight"], r["bias"]) for r in ranks}) == 1  # gradients were all-reduced across nodes
    assert {r["SLURMD_NODENAME"] for r in ranks} == {"node1", "node2"}
    assert {r["SLURM_JOB_ID"] for r in ranks} == {ranks[0]["SLURM_JOB_ID"]}
    assert not pwned.exists()
    assert any(line.startswith("[node1 rank3]") for line in lines)  # the job's output was streamed
    assert queue(slurm) == []


def test_cli_failing_rank_exit_status_and_tail(slurm, tmp_path):
    """Same exit-status rules as the local backend: the failing rank's code, its last lines."""
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "dtrain"), "launch", "--backend", "slurm", "--nodes", "2",
         "--procs-per-node", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run"), "--slurm-poll-interval",
         "0.3", "--", "python", DDP_REPORT, str(tmp_path / "rep"), "--fail-rank", "3"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert "rank 3 failed first" in proc.stdout
    assert "rank 3: deliberate failure marker" in proc.stderr  # the tail
    assert queue(slurm) == []


def test_cli_dry_run_prints_script_and_submits_nothing(slurm, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "dtrain"), "launch", "--backend", "slurm", "--nodes", "2",
         "--partition", "debug", "--time", "5", "--account", "ml", "--dry-run", "--run-dir", str(run_dir),
         "--", "python", "train.py", "$(id)"],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash\n") and f"#SBATCH --output={run_dir}/slurm-%j.out" in proc.stdout
    assert not run_dir.exists()  # a dry run writes nothing
    for line in ("#SBATCH --nodes=2", "#SBATCH --partition=debug", "#SBATCH --time=5", "#SBATCH --account=ml"):
        assert line + "\n" in proc.stdout
    assert "train.py '$(id)'" in proc.stdout
    assert queue(slurm) == [] and not list(run_dir.glob("slurm-*.out"))


def test_terminate_scancels_and_frees_every_process(slurm, tmp_path):
    spec = cpu_spec(["python", DDP_REPORT, str(tmp_path / "rep"), "--sleep", "120"], run_dir=str(tmp_path / "run"),
                    backend_options={"poll_interval": 0.3})
    lines: list[str] = []
    launcher = Launcher(spec, sink=lines.append)
    results = []
    thread = threading.Thread(target=lambda: results.append(launcher.run()))
    thread.start()
    wait_for(lambda: sum("sleeping" in line for line in lines) == 4, timeout=90, what="4 ranks sleeping")
    job_pids = slurm.job_pids()
    rank_pids = {int(line.rsplit("pid=", 1)[1]) for line in lines if "sleeping" in line}
    assert rank_pids <= job_pids and len(job_pids) > len(rank_pids)  # plus torchrun agents, srun, slurmstepd
    slurm_job_id = queue(slurm)[0]
    assert queue(slurm) == [slurm_job_id]
    launcher.terminate()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert results[0].stopped and results[0].exit_code == 143
    assert queue(slurm) == []
    # Slurm lists the job as ended once slurmd has signalled its steps; on a loaded machine the
    # last of them (and the node wrapper that stops a rank's setsid children) exit moments later.
    if not poll_until(lambda: alive(job_pids) == [] and slurm.job_pids() == set(), 30, 0.1):
        raise AssertionError(f"alive 30 s after the job ended: {describe(set(alive(job_pids)) | slurm.job_pids())}")
    state = slurm.run(["scontrol", "show", "job", "-o", slurm_job_id]).stdout
    assert "JobState=CANCELLED" in state


def test_query_of_a_job_slurm_never_knew_is_done_and_failed(slurm, tmp_path):
    from dtrain.launch.backends.slurm.backend import query

    status = query("999999", str(tmp_path))
    assert status.done and status.exit_code == 1 and status.state == "UNKNOWN"
    (tmp_path / "slurm-999999.exit").write_text("0\n")  # the batch script's record, if it got that far
    assert query("999999", str(tmp_path)).ok


def test_unreachable_controller_is_an_error_not_a_verdict(slurm, tmp_path, monkeypatch):
    """A slurmctld that does not answer must not turn a running job into a failed one."""
    import pytest

    from dtrain.errors import DTrainError
    from dtrain.launch.backends.slurm.backend import query
    from dtrain.launch.core.job import free_port

    conf = tmp_path / "slurm.conf"
    text = open(slurm.conf).read()
    port = [line for line in text.splitlines() if line.startswith("SlurmctldPort=")][0]
    conf.write_text(text.replace(port, f"SlurmctldPort={free_port()}").replace("MessageTimeout=10", "MessageTimeout=1"))
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(DTrainError, match="scontrol show job 1 failed"):
        query("1", str(tmp_path))
