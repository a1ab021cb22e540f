"""The per-record transform dtrain's preprocessing runs on every CSV row, and the same parsing for evaluation.

``dtrain preprocess --transform tabular_pipeline.prep:transform`` calls :func:`transform` with
one row as ``{header: text}``. Returning None drops the row; raising ValueError makes dtrain
quarantine it as a bad record (and fail the run above ``--max-bad-fraction``).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np

from tabular_pipeline.data import FEATURES

# Part of the shards' fingerprint: bump it when the parsing changes so old shards are not reused.
TRANSFORM_VERSION = "1"
FEATURE_COLUMNS = tuple(f"f{i}" for i in range(FEATURES))


def _number(record: Mapping[str, object], column: str) -> float:
    if column not in record:
        raise ValueError(f"column {column!r} is missing")
    text = record[column]
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"column {column!r} is not a number: {text!r}") from None
    if not math.isfinite(value):  # float() accepts "nan" and "inf"; a model cannot learn from them
        raise ValueError(f"column {column!r} is not finite: {text!r}")
    return value


def transform(record: Mapping[str, str]) -> dict[str, np.ndarray] | None:
    """One CSV row to ``{"x": float32 [8], "y": float32 scalar}``; None when the target is empty."""
    target = record.get("target")
    if target is None or not str(target).strip():  # unlabelled row: nothing to learn from, not an error
        return None
    x = np.array([_number(record, c) for c in FEATURE_COLUMNS], dtype=np.float32)
    y = np.float32(_number(record, "target"))
    return {"x": x, "y": y}


def features_and_target(rows: Iterable[Mapping[str, object]]) -> tuple[np.ndarray, np.ndarray]:
    """Parse rows exactly as training did: X float32 [n, 8], y float32 [n] (dropped rows left out)."""
    xs, ys = [], []
    for row in rows:
        out = transform({k: "" if v is None else str(v) for k, v in row.items()})
        if out is not None:
            xs.append(out["x"])
            ys.append(out["y"])
    x = np.stack(xs) if xs else np.zeros((0, FEATURES), dtype=np.float32)
    return x, np.asarray(ys, dtype=np.float32)
