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

from dtrain.preprocess import shardfmt
from dtrain.preprocess.errors import PreprocessError, RecordTooLarge
from dtrain.preprocess.inputs import EXCERPT, OversizedRecord
from dtrain.preprocess.store import Store
from dtrain.preprocess.transform import resolve

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


def _fields(out: Any, spec: dict[str, tuple] | None) -> dict[str, np.ndarray]:
    """Validate one transform output against the chunk's first good sample (``spec``: name -> (dtype, shape))."""
    if not isinstance(out, dict) or not out:
        raise TypeError(f"transform returned {type(out).__name__}, expected a non-empty dict of arrays or None")
    if spec is not None and out.keys() == spec.keys():  # the common case, checked without building names
        arrays = {}
        for name, value in out.items():
            array = np.asarray(value)
            dtype, shape = spec[name]
            if array.dtype != dtype or array.shape != shape:
                break
            arrays[name] = array
        else:
            return arrays
    arrays = {}
    for name, value in out.items():
        if not isinstance(name, str) or not shardfmt.FIELD_NAME.match(name):
            raise ValueError(f"field name {name!r} is not 1-64 characters of [A-Za-z0-9_]")
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise TypeError(f"field {name} has dtype {array.dtype}, expected bool, integer or float")
        arrays[name] = array
    if spec is not None:
        got = {n: (a.dtype.name, a.shape) for n, a in arrays.items()}
        want = {n: (d.name, s) for n, (d, s) in spec.items()}
        if got != want:
            raise ValueError(f"fields {got} differ from this shard's first sample {want}")
    return arrays


def process_chunk(task: dict[str, Any]) -> dict[str, Any]:
    ref = task["transform"]
    fn = _transforms.get(ref) or _transforms.setdefault(ref, resolve(ref))
    store = _stores.get(task["output"]) or _stores.setdefault(task["output"], Store(task["output"]))
    fmt, url, header = task["format"], task["file"], task.get("header")
    records = task["records"]
    if fmt == "npy":  # rows of one array, numbered from first_line
        records = [(task["first_line"] + i, row) for i, row in enumerate(records)]
    columns: dict[str, list] = {}
    spec = None
    bad, dropped = [], 0
    for line, raw in records:
        try:
            out = fn(_parse(fmt, raw, header))
            if out is None:
                dropped += 1
                continue
            arrays = _fields(out, spec)
        except Exception as e:  # noqa: BLE001 - any failure of a record is that record's fault
            bad.append({"file": url, "line": line, "reason": f"{type(e).__name__}: {e}"[:500],
                        "excerpt": _excerpt(raw), "partition": task["partition"], "shard": task["name"]})
            continue
        if spec is None:
            spec = {n: (a.dtype, a.shape) for n, a in arrays.items()}
            columns = {n: [] for n in arrays}
        for name, array in arrays.items():
            columns[name].append(array)
    stacked = {n: np.stack(v) for n, v in columns.items()}
    meta = {"fingerprint": task["fingerprint"], "file": url, "first_line": task["first_line"],
            "records": len(records), "dropped": dropped, "bad": len(bad), "quarantine": bad}
    return shardfmt.write_shard(store, task["partition"], task["name"], stacked, meta)
