"""Restarts that resume: with ``max_restarts=1`` a rank that dies mid-training (SIGKILL, or exit
status 3) is restarted by torchrun, every rank resumes from the last checkpoint, the job exits 0.

End to end with real processes on every backend that runs torchrun agents: local 1x2 and 2x2,
ssh 2x2 (two sshd "hosts") and slurm 2x2 (a real two-node cluster), each with both faults. The
training script is the package's reference script, unchanged, with one fault injected
(scripts/faulty_train.py): rank R dies right after step S, once per run directory.

What "resumes" means here, checked from what the job leaves behind:

* rank 0 printed ``resumed from checkpoint at step N`` and ``result.json`` says
  ``resumed_from_step == N``, N the last checkpoint before the fault;
* every rank's metrics (``metrics/rank{R}.jsonl``) are steps 1..k of the first attempt, then
  N+1 .. the last step: after the restart no rank starts again from step 1;
* the exit records show the fault (rank R, first attempt, 137 or 3) and a clean second attempt.

No timing asserts: each run is bounded by a hard timeout (a watchdog thread that calls
``Launcher.terminate``, which stops every rank on every node), so a restart that hangs fails
the test fast and leaves nothing behind. The bounds are generous: a healthy run with its one
restart takes 10-25 s here, a restart that hangs (the bug this guards) would take forever.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher, LaunchResult
from tests.launch.backends.slurm.conftest import cpu_spec, queue
from tests.remote_jobs import needs_sshd

pytestmark = pytest.mark.timeout(300)

HERE = os.path.dirname(os.path.abspath(__file__))
FAULTY = os.path.join(HERE, "scripts", "faulty_train.py")
EVERY = 5  # checkpoint interval
FAULT_STEP = 12  # not a multiple of EVERY: the job resumes from step 10 whichever rank dies
RESUME_STEP = FAULT_STEP // EVERY * EVERY
MODES = {"sigkill": 137, "exit3": 3}  # fault mode -> the rank's exit status (128 + SIGKILL)


def faulty_command(fault_rank: int, mode: str, epochs: int, step_sleep: float = 0.05) -> list[str]:
    return [sys.executable, FAULTY, "--fault-rank", str(fault_rank), "--fault-step", str(FAULT_STEP),
            "--fault-mode", mode, "--", "--epochs", str(epochs), "--checkpoint-every", str(EVERY),
            "--step-sleep", str(step_sleep)]


def run_bounded(spec: LaunchSpec, limit_s: float) -> tuple[LaunchResult, list[str], bool]:
    """Run ``spec``; after ``limit_s`` a watchdog stops every rank (the result then says stopped).
    Returns the result, the streamed lines and whether the watchdog fired."""
    lines: list[str] = []
    launcher = Launcher(spec, sink=lines.append)
    fired = threading.Event()

    def stop():
        fired.set()
        lines.append(f"[test] watchdog: still running after {limit_s:.0f} s, stopping the job")
        launcher.terminate()

    watchdog = threading.Timer(limit_s, stop)
    watchdog.daemon = True
    watchdog.start()
    try:
        result = launcher.run()
    finally:
        watchdog.cancel()
    return result, lines, fired.is_set()


def steps_by_rank(metrics_dir: str, world_size: int) -> dict[int, list[int]]:
    out = {}
    for rank in range(world_size):
        with open(os.path.join(metrics_dir, f"rank{rank}.jsonl"), encoding="utf-8") as fh:
            out[rank] = [json.loads(line)["step"] for line in fh if line.strip()]
    return out


def exit_records(run_dir: str) -> list[dict]:
    """The ranks' exit records (rank_entry), one per rank and restart count. torchrun counts a
    restart only on the node whose worker failed: the other node's second attempt has the same
    count as its first and replaces its record."""
    folder = os.path.join(run_dir, "exits")
    out = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            out.append(json.load(fh))
    return out


def assert_resumed(result: LaunchResult, lines: list[str], fired: bool, *, fault_rank: int, mode: str) -> None:
    log = "\n".join(lines[-60:])
    assert not fired, f"the job hung: not done within its bound\n{log}"
    assert result.exit_code == 0 and not result.stopped, log
    # The fault happened, once, where it was asked for.
    with open(os.path.join(result.run_dir, "fault-fired.json"), encoding="utf-8") as fh:
        fault = json.load(fh)
    assert (fault["rank"], fault["step"], fault["mode"], fault["restart"]) == (fault_rank, FAULT_STEP, mode, 0)
    assert sum("fault: rank" in line for line in lines) == 1, log
    records = exit_records(result.run_dir)
    assert any(r["rank"] == fault_rank and r["exit_code"] == MODES[mode] for r in records), records
    for rank in range(result.world_size):  # every rank's last attempt finished cleanly
        assert max((r for r in records if r["rank"] == rank), key=lambda r: r["time"])["exit_code"] == 0, rank
    # It resumed from the last checkpoint before the fault.
    assert f"[node0 rank0] resumed from checkpoint at step {RESUME_STEP}" in lines, log
    assert result.metrics["resumed_from_step"] == RESUME_STEP, result.metrics
    last = result.metrics["steps"]
    for rank, steps in steps_by_rank(result.metrics_dir, result.world_size).items():
        cut = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), None)  # the restart
        assert cut is not None, f"rank {rank} never restarted: {steps}"
        before, after = steps[:cut], steps[cut:]
        assert before == list(range(1, len(before) + 1)), (rank, steps)
        assert len(before) >= RESUME_STEP and (rank != fault_rank or before[-1] == FAULT_STEP), (rank, steps)
        assert after == list(range(RESUME_STEP + 1, last + 1)), (rank, steps)  # N+1 .. the end, not 1..


def local_spec(tmp_path, nodes: int, rank: int, mode: str, epochs: int, **kw) -> LaunchSpec:
    return LaunchSpec(command=faulty_command(rank, mode, epochs, **kw), nodes=nodes, procs_per_node=2,
                      device="cpu", max_restarts=1, run_dir=str(tmp_path / "run"))


# Which rank dies: rank 0 (the one that checkpoints, on the rendezvous host) for exit3, the last
# rank (on the last node) for sigkill, so both ends of the job are covered.
def fault_rank(mode: str, world_size: int) -> int:
    return 0 if mode == "exit3" else world_size - 1


@needs_sshd
@pytest.mark.parametrize("mode", sorted(MODES))
def test_ssh_restart_resumes_from_checkpoint(ssh_cluster, tmp_path, mode):
    rank = fault_rank(mode, 4)
    spec = LaunchSpec(command=faulty_command(rank, mode, epochs=2), nodes=2, procs_per_node=2, backend="ssh",
                      device="cpu", max_restarts=1, run_dir=str(tmp_path / "run"),
                      backend_options={"hostfile": ssh_cluster.hostfile(2), **ssh_cluster.ssh_settings()})
    result, lines, fired = run_bounded(spec, limit_s=150)
    assert_resumed(result, lines, fired, fault_rank=rank, mode=mode)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_slurm_restart_resumes_from_checkpoint(slurm, tmp_path, mode):
    rank = fault_rank(mode, 4)
    spec = cpu_spec(faulty_command(rank, mode, epochs=2), max_restarts=1, run_dir=str(tmp_path / "run"),
                    backend_options={"poll_interval": 0.3})
    result, lines, fired = run_bounded(spec, limit_s=150)
    assert_resumed(result, lines, fired, fault_rank=rank, mode=mode)
    assert queue(slurm) == []
