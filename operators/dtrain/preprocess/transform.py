"""Resolve a user transform named by import path (``mypkg.prep:transform``) and describe it.

A transform takes one parsed record (a dict for JSON lines, CSV and Parquet; a numpy row
for .npy) and returns a dict of array-like fields, or None to drop the record. Its identity
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
