"""Resume after a kill: SIGKILL a real ``dtrain preprocess`` (and its workers) mid-run, rerun it,
and get every finished shard kept and a result identical to an uninterrupted run."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time

import psutil

from .conftest import BIN, REPO, child_env, dtrain, read_tree

SLOW = "tests.preprocess.prep_transforms:digits_slow"


def shard_indexes(out: str) -> list[str]:
    return sorted(glob.glob(os.path.join(out, "parts", "*", "shard-*.json")))


def test_killed_run_resumes_keeping_finished_shards(tmp_path, digits_raw):
    raw = os.path.join(digits_raw, "part-000.jsonl")  # 479 records -> 10 shards of 50
    out, clean = str(tmp_path / "out"), str(tmp_path / "clean")
    args = ["preprocess", "--transform", SLOW, "--input", raw, "--workers", "2", "--shard-size", "50"]

    proc = subprocess.Popen([os.path.join(BIN, "dtrain"), *args, "--output", out], cwd=REPO,
                            env=child_env(PREP_TEST_SLEEP_S="0.01"), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(shard_indexes(out)) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the run finished before it could be killed"
        group = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGKILL)  # the runner and its workers die at once, as in a node crash
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert len(group) >= 3  # the runner and its two workers were all running
    _, alive = psutil.wait_procs(group, timeout=20)  # orphaned workers are reaped by init, not by us
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    kept = {p: os.stat(p).st_mtime_ns for p in shard_indexes(out)}
    assert 3 <= len(kept) < 10
    assert not os.path.exists(os.path.join(out, "manifest.json"))

    result = dtrain(*args, "--output", out)
    assert result.returncode == 0, result.stderr
    assert f"{10 - len(kept)} written, {len(kept)} kept from an earlier run" in result.stdout
    assert {p: os.stat(p).st_mtime_ns for p in kept} == kept  # finished shards were not rewritten

    result = dtrain(*args, "--output", clean)  # an uninterrupted run for comparison
    assert result.returncode == 0, result.stderr
    assert read_tree(out) == read_tree(clean)  # identical shards, indexes and manifest; no temp file left
