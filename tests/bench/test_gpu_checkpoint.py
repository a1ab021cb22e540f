"""bench/gpu_checkpoint.py run small on the CPU, as its own script, so a bench that needs a GPU to mean
anything cannot rot: it exits 0 and prints every line, each unjudged."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench",
                      "gpu_checkpoint.py")
NAMES = ["checkpoint: device-to-host copy (pinned)", "checkpoint: disk write+fsync", "checkpoint: disk read (cold)",
         "checkpoint: torch.save, fsynced", "checkpoint: DCP synchronous save", "checkpoint: DCP load",
         "checkpoint: DCP async stall, saves 2-5", "checkpoint: DCP async committed, saves 2-5",
         "checkpoint: training steps during the async write"]


@pytest.mark.slow  # a training job and a dozen checkpoints, even small
def test_the_quick_run_prints_every_line_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--quick", "--device", "cpu", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout.splitlines()
    assert [line.split(": ", 2)[0] + ": " + line.split(": ", 2)[1] for line in printed] == NAMES, done.stdout
    assert all(line.endswith(" [-]") for line in printed), done.stdout  # a quick run judges nothing
    assert list(tmp_path.iterdir()) == []  # its scratch folder is removed
