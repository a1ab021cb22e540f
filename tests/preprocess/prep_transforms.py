"""Transforms used only by the preprocessing tests (importable by spawned workers as tests.preprocess...)."""

from __future__ import annotations

import os
import time

import numpy as np

from dtrain.preprocess.examples import digits_features


def digits_slow(record):
    """digits_features, slowed down by PREP_TEST_SLEEP_S seconds per record (so a test can kill it mid-run)."""
    delay = float(os.environ.get("PREP_TEST_SLEEP_S", "0"))
    if delay:
        time.sleep(delay)
    return digits_features(record)


def indexed_row(row):
    """.npy rows [id, a, b, c]: the id as field i, the rest as x."""
    return {"i": np.int64(row[0]), "x": row[1:].astype(np.float32)}


def csv_row(record):
    """CSV records arrive as dicts of strings."""
    return {"x": np.float32(record["value"]), "y": np.int64(record["label"])}


def touch_marker(record):
    """digits_features that leaves the file PREP_TEST_MARKER when it runs: stands for code that a DAG
    param must never be able to choose (the test checks that it did not run)."""
    path = os.environ.get("PREP_TEST_MARKER")
    if path:
        open(path, "a").close()
    return digits_features(record)
