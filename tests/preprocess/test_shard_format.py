"""The shard writer's pieces: .npy files written from the array's own memory are np.save's bytes, and the
per-record field check of a worker keeps refusing what it refused."""

from __future__ import annotations

import io

import numpy as np
import pytest

from dtrain.preprocess import shardfmt
from dtrain.preprocess.store import Store
from dtrain.preprocess.worker import _fields


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32).reshape(4, 3),
    np.arange(24, dtype=np.uint8).reshape(2, 3, 4)[:, ::2],  # not contiguous
    np.array([True, False, True]),
    np.zeros((0, 5), dtype=np.float16),
    np.arange(6, dtype=">i8"),
], ids=["float32", "strided-uint8", "bool", "empty-float16", "big-endian-int64"])
def test_npy_parts_are_exactly_what_np_save_writes(tmp_path, array):
    expected = io.BytesIO()
    np.save(expected, np.ascontiguousarray(array), allow_pickle=False)
    parts = shardfmt.encode_array_parts(array)
    assert b"".join(bytes(p) for p in parts) == expected.getvalue() == shardfmt.encode_array(array)
    store = Store(str(tmp_path))
    store.write_parts("a/field.npy", parts)
    assert (tmp_path / "a" / "field.npy").read_bytes() == expected.getvalue()
    assert np.array_equal(np.load(tmp_path / "a" / "field.npy"), array)
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temp file left


def test_field_check_refuses_another_shape_dtype_or_field_after_the_first_sample():
    first = _fields({"x": np.zeros(3, np.float32), "y": np.int64(1)}, None)
    spec = {n: (a.dtype, a.shape) for n, a in first.items()}
    as_float64 = {"x": (np.dtype("float64"), (3,)), "y": spec["y"]}
    assert set(_fields({"x": [1.0, 2.0, 3.0], "y": 2}, as_float64)) == {"x", "y"}  # a list becomes an array
    assert _fields({"x": np.ones(3, ">f4"), "y": np.int64(2)}, spec)["x"].dtype == np.dtype(">f4")  # same name
    with pytest.raises(ValueError, match="differ from this shard's first sample"):
        _fields({"x": np.zeros(4, np.float32), "y": np.int64(1)}, spec)
    with pytest.raises(ValueError, match="differ from this shard's first sample"):
        _fields({"x": np.zeros(3, np.float64), "y": np.int64(1)}, spec)
    with pytest.raises(ValueError, match="differ from this shard's first sample"):
        _fields({"x": np.zeros(3, np.float32), "z": np.int64(1)}, spec)
    with pytest.raises(TypeError, match="expected bool, integer or float"):
        _fields({"x": np.array(["a", "b", "c"]), "y": np.int64(1)}, spec)
    with pytest.raises(ValueError, match="field name"):
        _fields({"x y": np.zeros(3, np.float32)}, spec)
