"""The shard format: ``.npy`` files per field per shard, a JSON index per shard, a dataset manifest.

Layout of a dataset directory::

    manifest.json                        written last, atomically: the dataset is published
    quarantine.jsonl                     bad records of every partition (file, line, reason)
    parts/<partition>/_partition.json    the partition is complete (written after its shards)
    parts/<partition>/quarantine.jsonl
    parts/<partition>/<shard>.<field>.npy   a fixed-shape field: one array, first axis = samples
    parts/<partition>/<shard>.<field>.values.npy    a variable-length field (1-D, any length; numbers
    parts/<partition>/<shard>.<field>.offsets.npy   or bytes): every sample end to end, and where each
                                                    starts (int64, samples + 1; see dtrain.preprocess.ragged)
    parts/<partition>/<shard>.json       shard index, written after its arrays: complete shard

A training sample here is a few numeric arrays (or byte strings). ``.npy`` is numpy's own format:
``np.load(mmap_mode="r")`` maps it with zero decoding, so a reader gathers a batch with one
fancy index per field and no per-sample Python work; random access (a global shuffle split by
rank) is free. bench/data_formats.py measures it against MDS, WebDataset and LitData written
and read with their own libraries (docs/preprocess.md has the table).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from typing import Any

import numpy as np

from dtrain.preprocess.errors import PreprocessError
from dtrain.preprocess.ragged import Ragged
from dtrain.preprocess.store import Store
from dtrain.preprocess.transform import FIELD_NAME

FORMAT = "dtrain-shards"
#: the newest version this code writes and reads: 2 added variable-length fields
FORMAT_VERSION = 2
#: a dataset of fixed-shape fields only is still published as version 1, so readers of 1 keep reading it
FIXED_ONLY_VERSION = 1
READABLE_VERSIONS = (FIXED_ONLY_VERSION, FORMAT_VERSION)
#: the dtype of a variable-length field of raw bytes (encoded images, audio, JSON): uint8 values
BYTES = "bytes"
MANIFEST = "manifest.json"
QUARANTINE = "quarantine.jsonl"
PARTS = "parts"
PARTITION_DONE = "_partition.json"


def dumps(obj: Any) -> str:
    """Canonical JSON (sorted keys, no timestamps): the same content gives the same bytes."""
    return json.dumps(obj, sort_keys=True, indent=1) + "\n"


def encode_array(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def encode_array_parts(array: np.ndarray) -> list:
    """The ``.npy`` file of ``array`` as [header bytes, a byte view of the array's own memory]: the same
    bytes as :func:`encode_array` (``np.save``), without the two whole-array copies (into a buffer,
    then out of it) that a shard of large samples would cost."""
    array = np.ascontiguousarray(array)
    if array.dtype.hasobject:
        raise PreprocessError(f"dtype {array.dtype} cannot be stored without pickle")
    header = io.BytesIO()
    # np.save writes format 1.0 whenever the header fits (always, for a shard's few dimensions).
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    return [header.getvalue(), memoryview(array.reshape(-1).view(np.uint8))]


def field_spec(value: np.ndarray | Ragged, is_bytes: bool = False) -> dict[str, Any]:
    """A fixed field: dtype and per-sample shape. A variable one: dtype (or "bytes") and its longest sample."""
    if isinstance(value, Ragged):
        return {"dtype": BYTES if is_bytes else value.values.dtype.name, "variable": True,
                "max_length": int(value.lengths.max(initial=0))}
    return {"dtype": value.dtype.name, "shape": list(value.shape[1:])}


def field_files(field: str, value: np.ndarray | Ragged) -> list[tuple[str, np.ndarray]]:
    """(file key, array) of a field: its key in a shard's ``files`` and the middle of its file name."""
    if isinstance(value, Ragged):
        return [(f"{field}.offsets", value.offsets), (f"{field}.values", value.values)]
    return [(field, value)]


def file_keys(field: str, spec: dict[str, Any]) -> list[str]:
    return [f"{field}.offsets", f"{field}.values"] if spec.get("variable") else [field]


def merge_fields(fields: dict[str, Any], other: dict[str, Any]) -> dict[str, Any] | None:
    """The fields of two shards as one dataset's (a variable field keeps the longer max_length), or None
    when they differ in names, dtypes, shapes or kind."""
    if fields.keys() != other.keys():
        return None
    merged = {}
    for name, spec in fields.items():
        if spec.get("variable") and other[name].get("variable") and spec["dtype"] == other[name]["dtype"]:
            merged[name] = {**spec, "max_length": max(spec["max_length"], other[name]["max_length"])}
        elif spec == other[name]:
            merged[name] = spec
        else:
            return None
    return merged


def manifest_version(fields: dict[str, Any]) -> int:
    return FORMAT_VERSION if any(spec.get("variable") for spec in fields.values()) else FIXED_ONLY_VERSION


def part_dir(partition: str) -> str:
    return f"{PARTS}/{partition}"


def write_shard(store: Store, partition: str, name: str, arrays: dict[str, np.ndarray | Ragged],
                meta: dict[str, Any], byte_fields: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Write each field's array(s), then the shard index (last: its presence means the shard is complete)."""
    files = {}
    num = None
    for field in sorted(arrays):
        value = arrays[field]
        num = len(value) if num is None else num
        if len(value) != num:
            raise PreprocessError(f"shard {name}: field {field} has {len(value)} samples, expected {num}")
        for key, array in field_files(field, value):
            parts = encode_array_parts(array)
            rel = f"{part_dir(partition)}/{name}.{key}.npy"
            store.write_parts(rel, parts)
            digest = hashlib.sha256()
            for part in parts:
                digest.update(part)
            files[key] = {"path": rel, "bytes": sum(len(part) for part in parts), "sha256": digest.hexdigest()}
    digests = hashlib.sha256()
    for key in sorted(files):
        digests.update(f"{key}:{files[key]['sha256']}\n".encode())
    index = {
        "name": name, "partition": partition, "num_samples": num or 0,
        "fields": {f: field_spec(v, f in byte_fields) for f, v in sorted(arrays.items())},
        "files": files, "sha256": digests.hexdigest() if files else None, **meta,
    }
    store.write_text(f"{part_dir(partition)}/{name}.json", dumps(index))
    return index


def read_json(store: Store, rel: str) -> dict[str, Any] | None:
    data = store.read_bytes(rel)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None  # a torn file cannot exist (atomic writes), but a hand-edited one can


def read_shard_index(store: Store, partition: str, name: str) -> dict[str, Any] | None:
    return read_json(store, f"{part_dir(partition)}/{name}.json")


def shard_intact(store: Store, index: dict[str, Any], verify: bool = True) -> bool:
    """Every field file is there with its recorded size (and checksum when ``verify``)."""
    for info in index.get("files", {}).values():
        if verify:
            data = store.read_bytes(info["path"])
            if data is None or len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
                return False
        elif store.size(info["path"]) != info["bytes"]:
            return False
    return True


def file_sha256(path: str, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


MAX_MANIFEST_BYTES = 256 << 20  # about 400,000 shards; a larger file is refused unread
MAX_DIMS = 32  # numpy's own limit is 64; a sample of more dimensions is a hostile manifest, not data
MAX_LENGTH_CAP = 1 << 40
SHARD_FILE = re.compile(r"^parts/[A-Za-z0-9][A-Za-z0-9._=-]{0,127}/[A-Za-z0-9][A-Za-z0-9._=-]{0,300}\.npy$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def load_manifest(directory: str) -> dict[str, Any]:
    """The manifest of a published dataset, checked (:func:`check_manifest`), or a clear error."""
    import os

    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as e:
        raise PreprocessError(f"{directory} is not a published dataset: {MANIFEST} is missing "
                              f"(preprocessing did not finish, or failed its bad-record check)") from e
    if len(data) > MAX_MANIFEST_BYTES:
        raise PreprocessError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest this reader loads")
    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise PreprocessError(f"{path} is not valid JSON: {e}") from e
    check_manifest(manifest, path)
    return manifest


def _refuse(where: str, value: Any, allowed: str) -> PreprocessError:
    return PreprocessError(f"{where}={value!r} is invalid: {allowed}")


def _count(value: Any, cap: int = MAX_LENGTH_CAP) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= cap


def _numeric(name: Any) -> bool:
    """A numpy dtype name of bool, integer or float (what a transform may return), in canonical spelling."""
    if not isinstance(name, str):
        return False
    try:
        dtype = np.dtype(name)
    except TypeError:
        return False
    return dtype.kind in "biuf" and dtype.name == name


def check_manifest(manifest: Any, path: str) -> None:
    """Every rule a reader relies on, checked once, before any shard file is opened: a manifest may be
    hostile (it decides dtypes, shapes, lengths and which files are opened). Refusals name the entry,
    its value and what is allowed."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("format_version") not in READABLE_VERSIONS:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        fmt = manifest.get("format") if isinstance(manifest, dict) else None
        raise PreprocessError(f"{path}: format {fmt!r} version {version!r} is not {FORMAT!r} version "
                              f"{' or '.join(map(str, READABLE_VERSIONS))}")
    fields = manifest.get("fields")
    if not isinstance(fields, dict) or not fields:
        raise _refuse(f"{path}: fields", fields, "a non-empty object of field name -> spec")
    for name, spec in fields.items():
        _check_field(f"{path}: fields.{name}", name, spec, manifest["format_version"])
    if not _count(manifest.get("num_samples")):
        raise _refuse(f"{path}: num_samples", manifest.get("num_samples"), "a whole number >= 0")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise _refuse(f"{path}: shards", type(shards).__name__, "a list")
    keys = sorted(key for name, spec in fields.items() for key in file_keys(name, spec))
    for i, shard in enumerate(shards):
        where = f"{path}: shards[{i}]"
        if not isinstance(shard, dict) or not _count(shard.get("num_samples")):
            raise _refuse(f"{where}.num_samples", shard.get("num_samples") if isinstance(shard, dict) else shard,
                          "a whole number >= 0")
        files = shard.get("files")
        if not isinstance(files, dict) or sorted(files) != keys:
            raise _refuse(f"{where}.files", sorted(files) if isinstance(files, dict) else files,
                          f"one entry per field file: {keys}")
        for key, info in files.items():
            _check_file(f"{where}.files.{key}", info)
    total = sum(shard["num_samples"] for shard in shards)
    if total != manifest["num_samples"]:
        raise PreprocessError(f"{path}: shards hold {total} samples, manifest says {manifest['num_samples']}")


def _check_field(where: str, name: Any, spec: Any, version: int) -> None:
    if not isinstance(name, str) or not FIELD_NAME.match(name):
        raise _refuse(where, name, "a field name of 1-64 characters of [A-Za-z0-9_]")
    if not isinstance(spec, dict):
        raise _refuse(where, spec, "an object with dtype and shape, or dtype, variable and max_length")
    if spec.get("variable") is True:
        if version < FORMAT_VERSION:
            raise _refuse(f"{where}.variable", True, f"only in format version {FORMAT_VERSION} manifests")
        if spec.get("dtype") != BYTES and not _numeric(spec.get("dtype")):
            raise _refuse(f"{where}.dtype", spec.get("dtype"), f"a bool, integer or float dtype name, or {BYTES!r}")
        if not _count(spec.get("max_length")):
            raise _refuse(f"{where}.max_length", spec.get("max_length"), f"a whole number from 0 to {MAX_LENGTH_CAP}")
        return
    if "variable" in spec:
        raise _refuse(f"{where}.variable", spec["variable"], "true (or absent: a fixed-shape field)")
    if not _numeric(spec.get("dtype")):
        raise _refuse(f"{where}.dtype", spec.get("dtype"), "a bool, integer or float dtype name, e.g. float32")
    shape = spec.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_count(d) for d in shape):
        raise _refuse(f"{where}.shape", shape, f"a list of at most {MAX_DIMS} whole numbers >= 0")


def _check_file(where: str, info: Any) -> None:
    if not isinstance(info, dict):
        raise _refuse(where, info, "an object with path, bytes and sha256")
    if not isinstance(info.get("path"), str) or not SHARD_FILE.match(info["path"]):
        raise _refuse(f"{where}.path", info.get("path"), "parts/<partition>/<file>.npy inside the dataset")
    if not _count(info.get("bytes")):
        raise _refuse(f"{where}.bytes", info.get("bytes"), "a whole number >= 0")
    if not isinstance(info.get("sha256"), str) or not SHA256.match(info["sha256"]):
        raise _refuse(f"{where}.sha256", info.get("sha256"), "64 lowercase hex digits")
