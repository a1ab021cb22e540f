"""The shard format: one ``.npy`` file per field per shard, a JSON index per shard, a dataset manifest.

Layout of a dataset directory::

    manifest.json                        written last, atomically: the dataset is published
    quarantine.jsonl                     bad records of every partition (file, line, reason)
    parts/<partition>/_partition.json    the partition is complete (written after its shards)
    parts/<partition>/quarantine.jsonl
    parts/<partition>/<shard>.<field>.npy   one array per field, first axis = samples
    parts/<partition>/<shard>.json       shard index, written after its arrays: complete shard

A training sample here is a few fixed-shape numeric arrays. ``.npy`` is numpy's own format:
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
from dtrain.preprocess.store import Store

FORMAT = "dtrain-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
QUARANTINE = "quarantine.jsonl"
PARTS = "parts"
PARTITION_DONE = "_partition.json"
FIELD_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")


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


def field_spec(array: np.ndarray) -> dict[str, Any]:
    """dtype and per-sample shape of a stacked field array."""
    return {"dtype": array.dtype.name, "shape": list(array.shape[1:])}


def part_dir(partition: str) -> str:
    return f"{PARTS}/{partition}"


def write_shard(store: Store, partition: str, name: str, arrays: dict[str, np.ndarray],
                meta: dict[str, Any]) -> dict[str, Any]:
    """Write each field's array, then the shard index (last: its presence means the shard is complete)."""
    files, digests = {}, hashlib.sha256()
    num = None
    for field in sorted(arrays):
        array = arrays[field]
        num = len(array) if num is None else num
        if len(array) != num:
            raise PreprocessError(f"shard {name}: field {field} has {len(array)} samples, expected {num}")
        parts = encode_array_parts(array)
        rel = f"{part_dir(partition)}/{name}.{field}.npy"
        store.write_parts(rel, parts)
        digest = hashlib.sha256()
        for part in parts:
            digest.update(part)
        sha = digest.hexdigest()
        digests.update(f"{field}:{sha}\n".encode())
        files[field] = {"path": rel, "bytes": sum(len(part) for part in parts), "sha256": sha}
    index = {
        "name": name, "partition": partition, "num_samples": num or 0,
        "fields": {f: field_spec(a) for f, a in sorted(arrays.items())},
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


def load_manifest(directory: str) -> dict[str, Any]:
    """The manifest of a published dataset, or a clear error when there is none."""
    import os

    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError as e:
        raise PreprocessError(f"{directory} is not a published dataset: {MANIFEST} is missing "
                              f"(preprocessing did not finish, or failed its bad-record check)") from e
    except ValueError as e:
        raise PreprocessError(f"{path} is not valid JSON: {e}") from e
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise PreprocessError(f"{path}: format {manifest.get('format')!r} version "
                              f"{manifest.get('format_version')!r} is not {FORMAT!r} version {FORMAT_VERSION}")
    return manifest
