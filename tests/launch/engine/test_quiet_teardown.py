"""A hung job's output ends with the verdict, not with every agent's shutdown (real torchrun agents,
two simulated nodes, gloo): no traceback per agent, no per-rank warning the user cannot act on
(TORCH_NCCL_TRACE_BUFFER_SIZE's deprecation on CPU), the agents' shutdown text kept in the run
directory, and no directory left in the temp folder by the job's agents (torchelastic_*).

The job gets a temp folder of its own (TMPDIR), so what its agents leave there is told apart from
what other runs left in /tmp."""

from __future__ import annotations

import os
import subprocess
import sys

from dtrain.launch.engine import hang

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HANG_TRAIN = os.path.join(REPO, "tests", "launch", "scripts", "hang_train.py")


def test_a_hang_on_two_nodes_ends_with_one_verdict_and_leaves_no_temp_dirs(tmp_path):
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-m", "dtrain.cli", "launch", "--device", "cpu", "--run-dir", str(run_dir),
            "--nodes", "2", "--procs-per-node", "1", "--hang-timeout", "8",
            "--", "python", HANG_TRAIN, "--silent-rank", "1", "--silent-step", "5"]
    env = dict(os.environ, TMPDIR=str(tmp), PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    run = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    out = run.stdout + run.stderr
    assert run.returncode == hang.HANG_EXIT_CODE, out[-3000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in out, out[-3000:]
    assert "death signal" not in out, out[-3000:]  # each agent's shutdown: in the run directory
    finished = [line for line in out.splitlines() if " finished: exit_code=124 " in line]
    assert len(finished) == 1 and finished[0].endswith("(hung: rank(s) 1 stuck)"), out[-3000:]
    assert out.rstrip().splitlines()[-1].startswith("[dtrain] hang detected: rank(s) 1 stuck"), out[-3000:]
    agent_logs = sorted(p.name for p in (run_dir / "logs").iterdir() if p.name.startswith("agent"))
    assert agent_logs == ["agent0.log", "agent1.log"]
    assert all("death signal" in (run_dir / "logs" / name).read_text() for name in agent_logs)
    assert sorted(os.listdir(tmp)) == []  # torchrun's agents made torchelastic_* here, one per agent
