"""bench/launch.py without its jobs: the jobs' DTRAIN_HOME (their run directories) is a temporary
folder that is gone when the bench ends, whether its runs succeed or not, and the ratio it prints is
the median of the pairs' own ratios."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "bench")


@pytest.fixture
def bench(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(BENCH)  # what running it as a script does: its `timing` import
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    spec = importlib.util.spec_from_file_location("bench_launch", os.path.join(BENCH, "launch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["launch.py", "--runs", "3"])
    return module


@pytest.mark.parametrize("fails", [False, True])
def test_the_jobs_home_exists_while_they_run_and_is_removed_after(bench, monkeypatch, tmp_path, fails):
    seen = []

    def run_pairs(runs, env):
        seen.append((runs, env["DTRAIN_HOME"], os.path.isdir(env["DTRAIN_HOME"]), env["OMP_NUM_THREADS"]))
        os.makedirs(os.path.join(env["DTRAIN_HOME"], "runs", "job"))  # what the jobs leave
        if fails:
            raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_pairs", run_pairs)
    if fails:
        with pytest.raises(KeyboardInterrupt):
            bench.main()
    else:
        bench.main()
    ((runs, home, existed, threads),) = seen
    assert (runs, existed, threads) == (3, True, "1")
    assert os.path.dirname(home) == str(tmp_path) and os.listdir(tmp_path) == []


def test_the_ratio_is_the_median_pairs_not_the_ratio_of_the_medians(bench):
    # the medians are equal (2.00 each); the pairs' ratios are 1.1, 1.5 and 0.8: a slow spell that
    # hit the second pair moved both of its figures
    times = {"dtrain": [1.1, 3.0, 2.0], "torchrun": [1.0, 2.0, 2.5]}
    assert bench.figures("wall", times) == "wall dtrain 2.00 s, torchrun 2.00 s, ratio 1.10"
    with pytest.raises(ValueError):  # figures of unpaired runs are a mistake, not a ratio
        bench.figures("cpu", {"dtrain": [1.0, 2.0], "torchrun": [1.0]})
