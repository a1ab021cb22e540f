"""Raw input: expand a URL (file, directory or glob, any fsspec filesystem) and cut it into chunks.

Each chunk holds up to ``shard_size`` input records of one file and becomes one shard, so
shard boundaries depend only on the input and ``shard_size``: never on the worker count.
The main process only splits lines (or reads Parquet/.npy rows); parsing and the transform
run in the workers, where a record that does not parse becomes a bad record.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterator

from dtrain.errors import SpecError
from dtrain.preprocess.errors import PreprocessError

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
           ".parquet": "parquet", ".pq": "parquet", ".npy": "npy"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class InputFile:
    url: str
    format: str
    size: int
    fingerprint: str  # size + etag/mtime: a changed file never reuses old shards


@dataclass
class Chunk:
    index: int
    records: list  # [(line, raw)] for jsonl/csv/parquet; for npy the rows array itself
    first_line: int
    header: list[str] | None = None


def detect_format(path: str) -> str | None:
    name = path.lower()
    for suffix in COMPRESSIONS:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    for ext, fmt in FORMATS.items():
        if name.endswith(ext):
            return fmt
    return None


def _fingerprint(info: dict[str, Any]) -> str:
    keys = ("size", "ETag", "etag", "mtime", "LastModified", "last_modified", "md5Hash", "generation")
    parts = [f"{k}={info[k]}" for k in keys if info.get(k) is not None]
    return hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]


def expand_input(url: str) -> list[InputFile]:
    """The input files under ``url`` in sorted order (hidden and ``_``-prefixed files skipped)."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise SpecError("input", url, f"an fsspec URL of a supported filesystem ({e})") from e
    allowed = "an existing file, directory or glob of " + ", ".join(sorted(FORMATS)) + \
        " files (optionally " + "/".join(COMPRESSIONS) + " compressed)"
    if GLOB_CHARS & set(path):
        paths = fs.glob(path)
    elif fs.isdir(path):
        paths = fs.find(path)
    elif fs.exists(path):
        if detect_format(path) is None:
            raise SpecError("input", url, allowed)
        paths = [path]
    else:
        raise SpecError("input", url, allowed)
    files = []
    for p in sorted(paths):
        base = p.rstrip("/").rsplit("/", 1)[-1]
        if base.startswith((".", "_")) or detect_format(p) is None:
            continue
        info = fs.info(p)
        if info.get("type") == "directory":
            continue
        files.append(InputFile(fs.unstrip_protocol(p), detect_format(p), int(info.get("size") or 0), _fingerprint(info)))
    if not files:
        raise SpecError("input", url, allowed + " (it matches no such file)")
    return files


def _open(url: str, mode: str = "rb"):
    import fsspec

    return fsspec.open(url, mode, compression="infer")


def iter_chunks(file: InputFile, shard_size: int) -> Iterator[Chunk]:
    try:
        if file.format in ("jsonl", "csv"):
            yield from _text_chunks(file, shard_size)
        elif file.format == "parquet":
            yield from _parquet_chunks(file, shard_size)
        else:
            yield from _npy_chunks(file, shard_size)
    except (OSError, ValueError, ImportError) as e:
        raise PreprocessError(f"cannot read {file.url} as {file.format}: {e}") from e


def _text_chunks(file: InputFile, shard_size: int) -> Iterator[Chunk]:
    with _open(file.url) as fh:
        header = None
        line_no = 0
        if file.format == "csv":
            first = fh.readline()
            line_no = 1
            import csv

            try:
                header = next(csv.reader([first.decode("utf-8-sig")]))
            except (UnicodeDecodeError, StopIteration) as e:
                raise PreprocessError(f"{file.url}: line 1 is not a CSV header: {e}") from e
            if not header or len(set(header)) != len(header):
                raise PreprocessError(f"{file.url}: CSV header {header!r} is empty or has duplicate names")
        chunk: list = []
        index = 0
        for raw in fh:
            line_no += 1
            if not raw.strip():
                continue  # blank lines are not records
            chunk.append((line_no, raw))
            if len(chunk) == shard_size:
                yield Chunk(index, chunk, chunk[0][0], header)
                chunk, index = [], index + 1
        if chunk:
            yield Chunk(index, chunk, chunk[0][0], header)


def _parquet_chunks(file: InputFile, shard_size: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    with _open(file.url) as fh:
        row = 0
        for index, batch in enumerate(pq.ParquetFile(fh).iter_batches(batch_size=shard_size)):
            records = [(row + i + 1, rec) for i, rec in enumerate(batch.to_pylist())]
            yield Chunk(index, records, row + 1)
            row += len(records)


def _npy_chunks(file: InputFile, shard_size: int) -> Iterator[Chunk]:
    import numpy as np

    with _open(file.url) as fh:
        array = np.load(fh, allow_pickle=False)
    if array.ndim == 0:
        raise PreprocessError(f"{file.url}: a 0-d array has no records (rows along the first axis)")
    for index, start in enumerate(range(0, len(array), shard_size)):
        yield Chunk(index, array[start:start + shard_size], start + 1)
