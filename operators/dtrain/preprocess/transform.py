"""Resolve a user transform named by import path (``mypkg.prep:transform``) and describe it.

A transform takes one parsed record (a dict for JSON lines, CSV and Parquet; a numpy row
for .npy) and returns a dict of array-like fields, or None to drop the record. A field is
fixed-shape unless the transform declares it variable-length (:func:`variable_length`: 1-D,
any length, e.g. token ids) or returns it as ``bytes`` (always variable: an encoded image,
a JSON document). Its identity
(name, version, hash of its module's source) goes into every shard's fingerprint, so a
changed transform never reuses shards made by the old one.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
from typing import Any, Callable

from dtrain.errors import SpecError

REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
ALLOWED = "an import path MODULE:FUNCTION, e.g. mypkg.prep:transform, naming a callable"
#: what a field of a transform's output may be called (it becomes part of file names)
FIELD_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")


def variable_length(*fields: str) -> Callable[[Callable], Callable]:
    """Declare fields of a transform's output variable-length (1-D arrays of any length)::

        @variable_length("input_ids")
        def transform(record): return {"input_ids": np.asarray(ids, np.int32)}

    Declared rather than guessed from the lengths: a record whose fixed-shape field has a wrong
    length is a bad record (quarantined), not a reason to change the dataset's schema.
    """
    def mark(fn: Callable) -> Callable:
        fn.variable_fields = tuple(fields)
        return fn
    return mark


def variable_fields(fn: Callable) -> frozenset[str]:
    """The fields ``fn`` declared variable-length, checked."""
    fields = getattr(fn, "variable_fields", ())
    if isinstance(fields, str) or not all(isinstance(f, str) and FIELD_NAME.match(f) for f in fields):
        raise SpecError("variable_fields", fields, "a tuple of field names of 1-64 characters of [A-Za-z0-9_]")
    return frozenset(fields)


def resolve(ref: str, field: str = "transform") -> Callable[[Any], Any]:
    if not isinstance(ref, str) or not REF.match(ref):
        raise SpecError(field, ref, ALLOWED)
    module_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise SpecError(field, ref, f"{ALLOWED} (cannot import {module_name}: {e})") from e
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise SpecError(field, ref, f"{ALLOWED} ({attr} is not a callable in {module_name})")
    return obj


def identity(ref: str) -> dict[str, Any]:
    """name, version (``fn.version``, else the module's TRANSFORM_VERSION or __version__) and code hash."""
    fn = resolve(ref)
    module = importlib.import_module(ref.partition(":")[0])
    version = getattr(fn, "version", None) or getattr(module, "TRANSFORM_VERSION", None) \
        or getattr(module, "__version__", None)
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        source = inspect.getsource(fn) if hasattr(fn, "__code__") else repr(fn)
    return {"name": ref, "version": None if version is None else str(version),
            "code_sha256": hashlib.sha256(source.encode("utf-8")).hexdigest()}
