"""bench/gpu_feed.py --quick as a user runs it: shards written by the preprocessing, the three feeds (ceiling,
DevicePrefetcher, DataLoader with 4 workers), quiet and with half the cores spinning, on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_the_feed_bench_runs_small_on_the_cpu_and_judges_nothing(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_feed.py"), "--quick", "--device", "cpu",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["feed"] * 3, done.stdout
    assert "gathers/s" in lines[0] and "alone" in lines[0]
    assert "quiet" in lines[1] and "cores busy" in lines[2]
    for line in lines[1:]:
        assert "ceiling" in line and "ours" in line and "DataLoader 4 workers pinned" in line
        assert line.endswith("[-]")  # quick: no goal judged
    assert os.listdir(tmp_path) == []  # its scratch folder went with it
