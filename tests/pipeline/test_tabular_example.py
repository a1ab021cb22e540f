"""The tabular example package (examples/tabular): its transform and data generator, and one small
end-to-end run through the real `dtrain preprocess` and `dtrain launch` (2 ranks on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tabular")
sys.path.insert(0, os.path.abspath(EXAMPLE))  # as a user's PYTHONPATH would

from tabular_pipeline.data import FEATURES, csv_bytes, generate_rows, write_csv  # noqa: E402
from tabular_pipeline.evaluate import evaluate  # noqa: E402
from tabular_pipeline.prep import features_and_target, transform  # noqa: E402

DTRAIN = os.path.join(os.path.dirname(sys.executable), "dtrain")


def _row(**overrides: str) -> dict[str, str]:
    row = {"id": "a", **{f"f{i}": str(i / 10) for i in range(FEATURES)}, "target": "1.5"}
    row.update(overrides)
    return row


def test_transform_parses_a_row():
    out = transform(_row())
    assert out["x"].dtype == np.float32 and out["x"].shape == (FEATURES,)
    assert out["x"].tolist() == pytest.approx([i / 10 for i in range(FEATURES)])
    assert np.asarray(out["y"]).dtype == np.float32 and np.asarray(out["y"]).shape == ()
    assert float(out["y"]) == 1.5


def test_transform_drops_a_row_without_target():
    assert transform(_row(target="")) is None
    assert transform(_row(target="  ")) is None


@pytest.mark.parametrize("column,text", [("f3", "abc"), ("f0", "nan"), ("target", "inf"), ("target", "abc")])
def test_transform_rejects_bad_values(column, text):
    with pytest.raises(ValueError, match=f"column '{column}'"):
        transform(_row(**{column: text}))


def test_generate_rows_is_deterministic_per_seed():
    a, b, c = generate_rows(50, seed=1), generate_rows(50, seed=1), generate_rows(50, seed=2)
    assert a == b
    assert [r["target"] for r in a] != [r["target"] for r in c]
    assert list(a[0]) == ["id", *(f"f{i}" for i in range(FEATURES)), "target"]


def test_csv_round_trips_through_the_transform(tmp_path):
    rows = generate_rows(20, seed=3)
    path = tmp_path / "rows.csv"
    write_csv(str(path), rows)
    assert path.read_bytes() == csv_bytes(rows)
    import csv

    with open(path, encoding="utf-8") as fh:
        x, y = features_and_target(csv.DictReader(fh))
    assert x.shape == (20, FEATURES) and y.dtype == np.float32
    assert y.tolist() == pytest.approx([r["target"] for r in rows], rel=1e-6)


def _run(argv: list[str], env: dict[str, str], timeout: float = 60) -> str:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv[:3]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _train(tmp_path, env, run_dir: str, output: str, init_from: str, epochs: int) -> dict:
    _run([DTRAIN, "launch", "--nodes", "1", "--procs-per-node", "2", "--run-dir", run_dir, "--",
          sys.executable, "-m", "tabular_pipeline.train", "--shards", str(tmp_path / "shards"),
          "--output", output, "--init-from", init_from, "--epochs", str(epochs), "--batch-size", "32"], env)
    with open(os.path.join(run_dir, "metrics", "result.json"), encoding="utf-8") as fh:
        return json.load(fh)


def test_preprocess_train_evaluate_and_warm_start(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.abspath(EXAMPLE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    rows = generate_rows(600, seed=1)
    # One unlabelled row (dropped) and one malformed row (quarantined) among the good ones.
    rows += [{**rows[0], "id": "unlabelled", "target": ""}, {**rows[0], "id": "bad", "f2": "abc"}]
    write_csv(str(tmp_path / "train.csv"), rows)
    heldout = generate_rows(300, seed=2)
    write_csv(str(tmp_path / "heldout.csv"), heldout)

    _run([DTRAIN, "preprocess", "--transform", "tabular_pipeline.prep:transform", "--input",
          str(tmp_path / "train.csv"), "--output", str(tmp_path / "shards"), "--workers", "1",
          "--max-bad-fraction", "0.01"], env)
    with open(tmp_path / "shards" / "manifest.json", encoding="utf-8") as fh:
        assert json.load(fh)["num_samples"] == 600

    model = str(tmp_path / "model.pt")
    first = _train(tmp_path, env, str(tmp_path / "run1"), model, "", epochs=3)
    assert first["world_size"] == 2 and first["warm_start_from"] is None and first["resumed_from_step"] == 0
    assert first["steps"] == 3 * (300 // 32) and first["model_path"] == model

    scores = evaluate(model, str(tmp_path / "heldout.csv"))
    target_std = float(np.std([r["target"] for r in heldout]))
    assert scores["samples"] == 300 and all(isinstance(v, float) for k, v in scores.items() if k != "samples")
    assert scores["rmse"] < 0.5 * target_std, (scores, target_std)  # it learned, not just the mean
    assert scores["r2"] > 0.5

    second = _train(tmp_path, env, str(tmp_path / "run2"), str(tmp_path / "model2.pt"), model, epochs=1)
    assert second["warm_start_from"] == model and second["steps"] == 300 // 32
    # One epoch on top of the learned weights stays about as good as they were; one epoch from
    # scratch is about twice as bad (so this fails if the warm start did not load them).
    warm = evaluate(str(tmp_path / "model2.pt"), str(tmp_path / "heldout.csv"))
    assert warm["rmse"] < 1.2 * scores["rmse"], (warm, scores)


def test_evaluate_reads_heldout_from_s3(tmp_path, s3_bucket):
    """s3:// works with the endpoint and keys only in the standard AWS environment variables."""
    import boto3
    import torch

    from tabular_pipeline.train import build_model

    torch.manual_seed(0)
    model = str(tmp_path / "untrained.pt")
    torch.save(build_model().state_dict(), model)
    rows = generate_rows(40, seed=5)
    write_csv(str(tmp_path / "heldout.csv"), rows)
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="2026-01-01.csv", Body=csv_bytes(rows))
    remote = evaluate(model, f"s3://{s3_bucket}/2026-01-01.csv")
    assert remote == evaluate(model, str(tmp_path / "heldout.csv"))
    assert remote["samples"] == 40
