"""What one worker process does with one chunk: parse, transform, stack, write the shard.

Runs in a pool process (or inline with one worker). Everything a record can do wrong is
caught here and recorded as a bad record with its file, line and reason; only failures
that are not the record's fault (disk full, a lost object store) propagate.
"""

from __future__ import annotations

import json
import pickle
import traceback
from typing import Any, Callable

import numpy as np

from dtrain.preprocess import packing, ragged, shardfmt
from dtrain.preprocess.errors import PreprocessError, RecordTooLarge
from dtrain.preprocess.inputs import EXCERPT, OversizedRecord
from dtrain.preprocess.packing import Packing
from dtrain.preprocess.store import Store
from dtrain.preprocess.transform import resolve, variable_fields

_transforms: dict[str, Callable] = {}
_stores: dict[str, Store] = {}


def serve(conn) -> None:
    """A pool process (dtrain.preprocess.runner._Pool): a chunk in, ``("ok", shard index)`` or
    ``("error", exception, traceback)`` out, one at a time, until None arrives or the pipe closes."""
    init_worker()
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the runner is gone
            return
        if task is None:
            return
        try:
            reply = ("ok", process_chunk(task))
        except Exception as e:  # noqa: BLE001 - the runner re-raises it, as a future would
            reply = ("error", _portable(e), traceback.format_exc())
        conn.send(reply)


def _portable(error: Exception) -> Exception:
    """``error`` if it survives pickling (what the pipe does to it), else a PreprocessError saying what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception type may fail to pickle or to rebuild
        return PreprocessError(f"{type(error).__name__}: {error}")


def init_worker() -> None:
    """Pool process set-up: die with the parent (a SIGKILLed runner leaves no orphan workers)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the pool's own shutdown still reaps workers on a clean exit


def _parse(fmt: str, raw: Any, header: list[str] | None) -> Any:
    if isinstance(raw, OversizedRecord):  # the reader skipped it: there is nothing to parse
        raise RecordTooLarge(raw.reason())
    if fmt == "jsonl":
        return json.loads(raw.decode("utf-8"))
    if fmt == "csv":
        import csv

        rows = list(csv.reader([raw.decode("utf-8")]))
        if len(rows) != 1 or len(rows[0]) != len(header):
            got = len(rows[0]) if rows else 0
            raise ValueError(f"CSV row has {got} fields, header has {len(header)}")
        return dict(zip(header, rows[0]))
    return raw  # parquet rows are dicts already, npy rows are arrays


def _excerpt(raw: Any) -> str | None:
    if isinstance(raw, OversizedRecord):
        raw = raw.head
    if isinstance(raw, bytes):
        return raw[:EXCERPT].decode("utf-8", "replace").rstrip("\r\n")
    return None


BYTES_TYPES = (bytes, bytearray, memoryview)


def _array(value: Any) -> np.ndarray:
    """A field value as an array: bytes become their uint8 values (a variable-length bytes field)."""
    return np.frombuffer(value, np.uint8) if isinstance(value, BYTES_TYPES) else np.asarray(value)


def _fields(out: Any, spec: dict[str, tuple] | None, variable: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """Validate one transform output against the chunk's first good sample (``spec``: name -> (dtype, shape),
    shape None for a variable-length field). ``variable``: the fields declared variable-length."""
    if not isinstance(out, dict) or not out:
        raise TypeError(f"transform returned {type(out).__name__}, expected a non-empty dict of arrays or None")
    if spec is not None and out.keys() == spec.keys():  # the common case, checked without building names
        arrays = {}
        for name, value in out.items():
            array = _array(value)
            dtype, shape = spec[name]
            if array.dtype != dtype or (array.ndim != 1 if shape is None else array.shape != shape):
                break
            arrays[name] = array
        else:
            return arrays
    arrays = {}
    for name, value in out.items():
        if not isinstance(name, str) or not shardfmt.FIELD_NAME.match(name):
            raise ValueError(f"field name {name!r} is not 1-64 characters of [A-Za-z0-9_]")
        array = _array(value)
        if array.dtype.kind not in "biuf":
            raise TypeError(f"field {name} has dtype {array.dtype}, expected bool, integer or float (or bytes)")
        if (name in variable or isinstance(value, BYTES_TYPES)) and array.ndim != 1:
            raise ValueError(f"field {name} is variable-length: expected a 1-D array, got shape {array.shape}")
        arrays[name] = array
    if spec is not None:
        got = {n: (a.dtype.name, "any length" if n in variable or isinstance(out[n], BYTES_TYPES) else a.shape)
               for n, a in arrays.items()}
        want = {n: (d.name, "any length" if s is None else s) for n, (d, s) in spec.items()}
        if got != want:
            raise ValueError(f"fields {got} differ from this shard's first sample {want}")
    return arrays


def _pack(columns: dict[str, list], spec: dict[str, tuple], pack: Packing) -> tuple[dict, dict[str, int]]:
    """The chunk's sequences of the packed field as blocks; any other field is a setting error."""
    if set(columns) - {pack.field}:
        raise PreprocessError(f"pack: the transform returned fields {sorted(columns)}; a packed dataset holds "
                              f"only the packed field {pack.field!r} (its blocks span records, so other "
                              f"per-record fields have no place): return {pack.field!r} alone")
    if not columns:
        return {}, {"sequences": 0, "tokens": 0, "dropped_tokens": 0}
    blocks, counts = packing.pack(columns[pack.field], spec[pack.field][0], pack)
    return {pack.field: blocks}, counts


def process_chunk(task: dict[str, Any]) -> dict[str, Any]:
    ref = task["transform"]
    fn = _transforms.get(ref) or _transforms.setdefault(ref, resolve(ref))
    store = _stores.get(task["output"]) or _stores.setdefault(task["output"], Store(task["output"]))
    fmt, url, header = task["format"], task["file"], task.get("header")
    pack = task.get("pack") and Packing(**task["pack"])
    variable = variable_fields(fn) | ({pack.field} if pack else set())
    records = task["records"]
    if fmt == "npy":  # rows of one array, numbered from first_line
        records = [(task["first_line"] + i, row) for i, row in enumerate(records)]
    columns: dict[str, list] = {}
    spec, byte_fields = None, frozenset()
    bad, dropped = [], 0
    for line, raw in records:
        try:
            out = fn(_parse(fmt, raw, header))
            if out is None:
                dropped += 1
                continue
            arrays = _fields(out, spec, variable)
        except Exception as e:  # noqa: BLE001 - any failure of a record is that record's fault
            bad.append({"file": url, "line": line, "reason": f"{type(e).__name__}: {e}"[:500],
                        "excerpt": _excerpt(raw), "partition": task["partition"], "shard": task["name"]})
            continue
        if spec is None:  # the first good sample: which fields vary in length, and every field's dtype
            byte_fields = frozenset(n for n, v in out.items() if isinstance(v, BYTES_TYPES))
            spec = {n: (a.dtype, None if n in variable | byte_fields else a.shape) for n, a in arrays.items()}
            columns = {n: [] for n in arrays}
        for name, array in arrays.items():
            columns[name].append(array)
    meta = {"fingerprint": task["fingerprint"], "file": url, "first_line": task["first_line"],
            "records": len(records), "dropped": dropped, "bad": len(bad), "quarantine": bad}
    if pack:
        stacked, meta["packing"] = _pack(columns, spec, pack)
    else:
        stacked = {n: np.stack(v) if spec[n][1] is not None else ragged.from_samples(v, spec[n][0])
                   for n, v in columns.items()}
    return shardfmt.write_shard(store, task["partition"], task["name"], stacked, meta, byte_fields)
