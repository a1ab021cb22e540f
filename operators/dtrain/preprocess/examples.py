"""Example transforms for scikit-learn's digits, as JSON lines ``{"id", "pixels": [64 ints 0-16], "label"}``.

    dtrain preprocess --transform dtrain.preprocess.examples:digits_features \\
        --input /data/digits-raw/ --output /data/digits-shards

``digits_features`` is cheap (scale to [0, 1]); ``digits_heavy`` stands in for a costly
decode + augmentation (upsample, smooth many times, pool back) and is what the benchmark
applies on the fly versus once into shards. Both give the fields the reference training
script reads: ``x`` float32 (64,), ``y`` int64 scalar.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

TRANSFORM_VERSION = "1"
HEAVY_ROUNDS = 24  # about 1 ms of CPU per record on one core of a 2-core x86-64 machine


def _pixels(record: dict[str, Any]) -> np.ndarray:
    pixels = np.asarray(record["pixels"], dtype=np.float32)
    if pixels.shape != (64,) or pixels.min() < 0 or pixels.max() > 16:
        raise ValueError(f"pixels must be 64 values in [0, 16], got shape {pixels.shape}")
    return pixels


def digits_features(record: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """Scale the 8x8 image to [0, 1]; drop records without a label (None = drop, not bad)."""
    if record.get("label") is None:
        return None
    return {"x": _pixels(record) / np.float32(16.0), "y": np.int64(record["label"])}


def digits_heavy(record: dict[str, Any], rounds: int = HEAVY_ROUNDS) -> dict[str, np.ndarray] | None:
    """CPU-heavy on purpose: upsample to 64x64, smooth ``rounds`` times, average back to 8x8."""
    if record.get("label") is None:
        return None
    image = np.kron(_pixels(record).astype(np.float64).reshape(8, 8) / 16.0, np.ones((8, 8)))
    for _ in range(rounds):
        padded = np.pad(image, 1, mode="edge")
        image = (padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:]
                 + 4.0 * padded[1:-1, 1:-1]) / 8.0
    small = image.reshape(8, 8, 8, 8).mean(axis=(1, 3))
    return {"x": small.astype(np.float32).reshape(64), "y": np.int64(record["label"])}


def digits_records(seed: int = 0, split: str = "train", repeat: int = 1) -> list[dict[str, Any]]:
    """The reference script's split of digits as raw records (integer pixels, as scanned)."""
    from dtrain.preprocess.digits import load_digits_arrays

    pixels, labels = load_digits_arrays()
    order = np.random.default_rng(seed).permutation(len(pixels))
    cut = int(len(order) * 0.8)
    chosen = order[:cut] if split == "train" else order[cut:]
    records = []
    for r in range(repeat):
        for i in chosen:
            records.append({"id": f"{r}-{int(i)}", "pixels": [int(v) for v in pixels[i]],
                            "label": int(labels[i])})
    return records


def write_digits_jsonl(directory: str, partitions: int = 1, seed: int = 0, repeat: int = 1) -> list[str]:
    """Write the training split as ``partitions`` JSON-lines files; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    records = digits_records(seed=seed, repeat=repeat)
    paths = []
    for p in range(partitions):
        path = os.path.join(directory, f"part-{p:03d}.jsonl")
        with open(path, "w", encoding="utf-8") as fh:
            for record in records[p::partitions]:
                fh.write(json.dumps(record) + "\n")
        paths.append(path)
    return paths
