"""The reference script's digits, read from scikit-learn's bundled CSV, are scikit-learn's load_digits()."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from dtrain.preprocess import digits


def _assert_same_as_sklearn(pixels, labels):
    from sklearn.datasets import load_digits

    expected = load_digits()
    assert pixels.dtype == expected.data.dtype and labels.dtype == expected.target.dtype
    np.testing.assert_array_equal(pixels, expected.data)
    np.testing.assert_array_equal(labels, expected.target)


def test_bundled_csv_is_load_digits():
    assert digits._bundled_csv() is not None  # the fast path is the one taken here
    _assert_same_as_sklearn(*digits.load_digits_arrays())


def test_without_the_bundled_csv_load_digits_is_used(monkeypatch):
    monkeypatch.setattr(digits, "_bundled_csv", lambda: None)
    _assert_same_as_sklearn(*digits.load_digits_arrays())


def test_the_reference_split_does_not_import_sklearn():
    # What each rank runs: the split costs no scikit-learn import (about 2 s of CPU per rank).
    code = ("import sys; from dtrain.training.reference.train_digits import load_digits_split; "
            "(x, y), _ = load_digits_split(0); assert x.shape == (1437, 64), x.shape; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sklearn'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
