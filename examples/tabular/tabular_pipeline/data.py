"""Synthetic tabular data: 8 standard-normal features and a noisy target from one fixed function.

The true function's weights come from a constant seed, not the caller's, so every date's data
(whatever ``seed`` it is generated with) shares it and a model trained on one date transfers.
"""

from __future__ import annotations

import csv
import io
import os
from typing import IO, Union

import numpy as np

FEATURES = 8
COLUMNS = ["id", *(f"f{i}" for i in range(FEATURES)), "target"]
_TRUE_SEED = 20240101  # fixed: the function to learn must not change with the data seed

Row = dict[str, Union[str, float]]


def _true_weights() -> tuple[np.ndarray, float]:
    rng = np.random.default_rng(_TRUE_SEED)
    return rng.normal(0.0, 1.0, FEATURES), float(rng.normal(0.0, 0.5))


def true_function(x: np.ndarray) -> np.ndarray:
    """The noiseless target for features ``x`` of shape [n, FEATURES]: linear plus a small nonlinearity."""
    weights, bias = _true_weights()
    return x @ weights + bias + 0.5 * np.sin(x[:, 0])


def generate_rows(n: int, seed: int, label_noise: float = 0.1) -> list[Row]:
    """``n`` rows with columns id, f0..f7, target; the same ``seed`` gives the same rows."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, (n, FEATURES))
    y = true_function(x) + rng.normal(0.0, label_noise, n)
    rows: list[Row] = []
    for i in range(n):
        row: Row = {"id": f"{seed}-{i}"}
        row.update({f"f{j}": float(x[i, j]) for j in range(FEATURES)})
        row["target"] = float(y[i])
        rows.append(row)
    return rows


def write_csv(path_or_fileobj: Union[str, os.PathLike, IO[str]], rows: list[Row]) -> None:
    """Write ``rows`` as CSV with a header line, to a path or an open text file."""
    if isinstance(path_or_fileobj, (str, os.PathLike)):
        with open(path_or_fileobj, "w", encoding="utf-8", newline="") as fh:
            _write(fh, rows)
    else:
        _write(path_or_fileobj, rows)


def _write(fh: IO[str], rows: list[Row]) -> None:
    writer = csv.DictWriter(fh, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)  # str(float) round-trips exactly, so the CSV loses no precision


def csv_bytes(rows: list[Row]) -> bytes:
    """The CSV file's bytes, e.g. to upload as one S3 object."""
    buffer = io.StringIO()
    _write(buffer, rows)
    return buffer.getvalue().encode("utf-8")
