"""Transforms with variable-length fields, for the shard-format tests (importable by spawned workers).

Records are JSON lines ``{"id": int, "n": length}``: the sample's token ids are ``id * 1000 + 0..n-1``,
so any test can recompute every value it should read back.
"""

from __future__ import annotations

import numpy as np

from dtrain.preprocess.transform import variable_length


def tokens_of(record) -> np.ndarray:
    return (record["id"] * 1000 + np.arange(record["n"])).astype(np.int32)


@variable_length("ids")
def mixed(record):
    """A variable int32 field, a bytes field (always variable) and a fixed label: three kinds in one shard."""
    if record.get("shape") == "2d":  # a declared variable field must be 1-D: this record is bad
        return {"ids": np.zeros((2, 2), np.int32), "blob": b"", "label": np.int64(0)}
    return {"ids": tokens_of(record), "blob": f"doc-{record['id']}".encode() * (record["n"] % 3),
            "label": np.int64(record["id"] % 7)}


@variable_length("ids")
def tokens(record):
    """Only the token ids: what packing takes."""
    return {"ids": tokens_of(record)}


@variable_length("ids")
def tokens_and_label(record):
    """Token ids and a per-record field: packing refuses it (blocks span records)."""
    return {"ids": tokens_of(record), "label": np.int64(1)}


def records(count: int, seed: int = 0) -> list[dict]:
    """``count`` records with long-tailed lengths, some empty."""
    lengths = np.random.default_rng(seed).zipf(1.6, count) % 60
    return [{"id": i, "n": int(n)} for i, n in enumerate(lengths)]
