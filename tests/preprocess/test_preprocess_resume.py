"""Resume after a kill: SIGKILL a real ``dtrain preprocess`` (and its workers) mid-run, rerun it,
and get every finished shard kept and a result identical to an uninterrupted run."""

from __future__ import annotations

import os

import psutil

from .conftest import dtrain, kill_mid_run, read_tree, shard_indexes

SLOW = "tests.preprocess.prep_transforms:digits_slow"


def test_killed_run_resumes_keeping_finished_shards(tmp_path, digits_raw):
    raw = os.path.join(digits_raw, "part-000.jsonl")  # 479 records -> 10 shards of 50
    out, clean = str(tmp_path / "out"), str(tmp_path / "clean")
    args = ["preprocess", "--transform", SLOW, "--input", raw, "--workers", "2", "--shard-size", "50"]

    group = kill_mid_run(args, out, shards=3)
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
