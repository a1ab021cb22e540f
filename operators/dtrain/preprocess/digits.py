"""scikit-learn's digits (the UCI 8x8 handwritten digits it ships), read without importing scikit-learn.

Importing ``sklearn.datasets`` costs about 2 s of CPU, in every rank of every run of the reference
script, for a 1797-row CSV. scikit-learn keeps that CSV as ``sklearn/datasets/data/digits.csv.gz``
(64 pixel columns, then the label); this reads it the way ``load_digits`` does. Where an installed
scikit-learn keeps it elsewhere, ``load_digits`` itself is used. Read by the reference script
(dtrain.training.reference.train_digits) and by the example datasets (dtrain.preprocess.examples).
"""

from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np

DIGITS_CSV = os.path.join("datasets", "data", "digits.csv.gz")


def _bundled_csv() -> str | None:
    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, DIGITS_CSV)
        if os.path.isfile(path):
            return path
    return None


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(data, target)`` as ``sklearn.datasets.load_digits()`` returns them: float64 (1797, 64)
    pixels in 0..16 and int labels."""
    path = _bundled_csv()
    if path is None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.data, digits.target
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        table = np.loadtxt(fh, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int, copy=False)
