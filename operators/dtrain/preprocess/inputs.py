"""Raw input: expand a URL (file, directory or glob, any fsspec filesystem) and cut it into chunks.

Each chunk holds up to ``shard_size`` input records of one file and becomes one shard, so
shard boundaries depend only on the input and ``shard_size``: never on the worker count.
The main process only splits lines (or reads Parquet/.npy rows); parsing and the transform
run in the workers, where a record that does not parse becomes a bad record.

Input may be hostile (a few hundred KB of gzip inflate to a line of gigabytes), so what is
read here is bounded by ``max_record_bytes`` (default 64 MiB), per record:

- JSON lines / CSV: a line is read in pieces of at most 1 MiB and dropped as soon as it is
  longer than the limit; the rest of it is skipped piece by piece. It reaches the workers as
  an :class:`OversizedRecord` (its size and first bytes), which they quarantine.
- .npy: the header is read first (numpy caps its size); rows larger than the limit refuse the
  file; C-order data is then read one chunk of rows at a time, never whole. Fortran-order
  data is read whole: up to the limit, or up to the size of an uncompressed file.
- Parquet: a row group whose declared uncompressed size averages more than the limit per row
  refuses the file before anything is decoded.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from typing import Any, Iterator

from dtrain.errors import SpecError
from dtrain.preprocess.errors import PreprocessError

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
           ".parquet": "parquet", ".pq": "parquet", ".npy": "npy"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
GLOB_CHARS = set("*?[")
DEFAULT_MAX_RECORD_BYTES = 64 << 20
MAX_RECORD_BYTES_CAP = 1 << 40  # no record is a TiB: a larger limit is a typo, not a choice
READ_BLOCK = 1 << 20  # a line is read (or skipped) at most this many bytes at a time
EXCERPT = 200  # first bytes of a bad record kept for quarantine.jsonl
NPY_BLOCK = 16 << 20  # .npy data is copied into its array this many bytes at a time


@dataclass(frozen=True)
class InputFile:
    url: str
    format: str
    size: int
    fingerprint: str  # size + etag/mtime: a changed file never reuses old shards


@dataclass(frozen=True)
class OversizedRecord:
    """A line above ``max_record_bytes``, skipped while reading: only its size and first bytes travel on."""

    size: int  # bytes, without the line ending
    limit: int
    head: bytes

    def reason(self) -> str:
        return (f"the record is {self.size} bytes, above max_record_bytes={self.limit} ({describe_bytes(self.limit)}); "
                f"skipped while reading, never held in memory")


def describe_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} bytes"


@dataclass
class Chunk:
    index: int
    records: list  # [(line, raw or OversizedRecord)] for jsonl/csv/parquet; for npy the rows array itself
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


def iter_chunks(file: InputFile, shard_size: int, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[Chunk]:
    try:
        if file.format in ("jsonl", "csv"):
            yield from _text_chunks(file, shard_size, max_record_bytes)
        elif file.format == "parquet":
            yield from _parquet_chunks(file, shard_size, max_record_bytes)
        else:
            yield from _npy_chunks(file, shard_size, max_record_bytes)
    # EOFError: a truncated .gz/.bz2/.xz; MemoryError: a .npy header declaring more than this host holds
    except (OSError, EOFError, ValueError, ImportError, MemoryError) as e:
        raise PreprocessError(f"cannot read {file.url} as {file.format}: {e}") from e


def _buffered(fh):
    """A stream whose ``readline`` takes a size. fsspec's own buffered files (s3, gcs, ...) take
    none and read to the newline whatever its distance; io.BufferedReader over them bounds it."""
    return fh if isinstance(fh, io.BufferedIOBase) else io.BufferedReader(fh, READ_BLOCK)


def _ending(part: bytes) -> int:
    return 2 if part.endswith(b"\r\n") else 1 if part.endswith(b"\n") else 0


def read_line(stream, limit: int) -> bytes | OversizedRecord:
    """The next line (b"" at the end of the stream), or an OversizedRecord when it holds more than
    ``limit`` bytes before its line ending.

    At most limit + 2 x READ_BLOCK bytes of a line are ever held: it is read in pieces, given
    up as soon as it is over the limit, and the rest is skipped piece by piece.
    """
    part = stream.readline(READ_BLOCK)
    if not part or part.endswith(b"\n"):  # the usual case: a whole line in one read
        return _within(part, limit)
    buf = bytearray(part)
    while len(buf) <= limit + 1:  # + 1: a trailing \r may still belong to a \r\n ending
        part = stream.readline(READ_BLOCK)
        buf += part
        if not part or part.endswith(b"\n"):
            return _within(bytes(buf), limit)
    return OversizedRecord(len(buf) + _skip_line(stream), limit, bytes(buf[:EXCERPT]))


def _within(line: bytes, limit: int) -> bytes | OversizedRecord:
    size = len(line) - _ending(line)
    return line if size <= limit else OversizedRecord(size, limit, line[:EXCERPT])


def _skip_line(stream) -> int:
    """Read past the rest of the current line, READ_BLOCK at a time, keeping none of it; its size."""
    skipped = 0
    while True:
        part = stream.readline(READ_BLOCK)
        skipped += len(part) - _ending(part)
        if not part or part.endswith(b"\n"):
            return skipped


def _csv_header(stream, file: InputFile, limit: int) -> list[str]:
    import csv

    first = read_line(stream, limit)
    if isinstance(first, OversizedRecord):
        raise PreprocessError(f"{file.url}: line 1 (the CSV header) is {first.size} bytes, above "
                              f"max_record_bytes={limit} ({describe_bytes(limit)})")
    try:
        header = next(csv.reader([first.decode("utf-8-sig")]))
    except (UnicodeDecodeError, StopIteration) as e:
        raise PreprocessError(f"{file.url}: line 1 is not a CSV header: {e}") from e
    if not header or len(set(header)) != len(header):
        raise PreprocessError(f"{file.url}: CSV header {header!r} is empty or has duplicate names")
    return header


def _text_chunks(file: InputFile, shard_size: int, limit: int) -> Iterator[Chunk]:
    with _open(file.url) as fh:
        stream = _buffered(fh)
        header = _csv_header(stream, file, limit) if file.format == "csv" else None
        line_no = 1 if header is not None else 0
        chunk: list = []
        index = 0
        while (raw := read_line(stream, limit)) != b"":
            line_no += 1
            if isinstance(raw, bytes) and not raw.strip():
                continue  # blank lines are not records
            chunk.append((line_no, raw))
            if len(chunk) == shard_size:
                yield Chunk(index, chunk, chunk[0][0], header)
                chunk, index = [], index + 1
        if chunk:
            yield Chunk(index, chunk, chunk[0][0], header)


def _parquet_chunks(file: InputFile, shard_size: int, limit: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    with _open(file.url) as fh:
        parquet = pq.ParquetFile(fh)
        _check_row_groups(parquet.metadata, file, limit)
        row = 0
        for index, batch in enumerate(parquet.iter_batches(batch_size=shard_size)):
            records = [(row + i + 1, rec) for i, rec in enumerate(batch.to_pylist())]
            yield Chunk(index, records, row + 1)
            row += len(records)


def _check_row_groups(metadata, file: InputFile, limit: int) -> None:
    """Refuse, before decoding, a row group whose rows average more than ``limit`` bytes: at least
    one of its records is over the limit, and pyarrow decodes a value whole (the one-huge-value
    bomb). The sizes are the file's own declaration; one huge value among many small rows of one
    row group is not caught here (pyarrow decodes it page by page)."""
    for i in range(metadata.num_row_groups):
        group = metadata.row_group(i)
        if group.total_byte_size > limit * max(group.num_rows, 1):
            raise PreprocessError(
                f"{file.url}: Parquet row group {i} declares {group.total_byte_size} bytes for {group.num_rows} "
                f"row(s), more than max_record_bytes={limit} ({describe_bytes(limit)}) per row; nothing decoded")


def _npy_chunks(file: InputFile, shard_size: int, limit: int) -> Iterator[Chunk]:
    with _open(file.url) as fh:
        shape, fortran_order, dtype = _npy_header(fh, file)
        if not shape:
            raise PreprocessError(f"{file.url}: a 0-d array has no records (rows along the first axis)")
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        if row_bytes > limit:
            raise PreprocessError(f"{file.url}: its rows are {row_bytes} bytes each, above max_record_bytes={limit} "
                                  f"({describe_bytes(limit)}); nothing read past the header")
        if fortran_order and len(shape) > 1:
            yield from _npy_fortran_chunks(fh, file, shape, dtype, shard_size, limit)
            return
        for index, start in enumerate(range(0, shape[0], shard_size)):  # C order: rows follow each other
            rows = min(shard_size, shape[0] - start)
            yield Chunk(index, _read_array(fh, (rows, *shape[1:]), dtype, file), start + 1)


def _npy_header(fh, file: InputFile):
    """(shape, fortran_order, dtype) from numpy's public readers (which cap the header's size)."""
    from numpy.lib import format as npy

    version = npy.read_magic(fh)
    readers = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}
    if version not in readers:  # 3.0 only differs by UTF-8 field names, and has no public reader
        raise PreprocessError(f"{file.url}: .npy format version {version[0]}.{version[1]} is not supported "
                              f"(1.0 and 2.0 are: save without non-Latin-1 field names)")
    shape, fortran_order, dtype = readers[version](fh)
    if dtype.hasobject:
        raise PreprocessError(f"{file.url}: an object array needs pickle to load, which is never allowed")
    return shape, fortran_order, dtype


def _npy_fortran_chunks(fh, file: InputFile, shape, dtype, shard_size: int, limit: int) -> Iterator[Chunk]:
    """Column-major data holds no row in one piece, so the array is read whole: only when it is
    within the per-record limit, or within an uncompressed file's size (which it cannot inflate)."""
    total = dtype.itemsize * math.prod(shape)
    if total > max(limit, 0 if _compressed(file.url) else file.size):
        raise PreprocessError(f"{file.url}: a Fortran-order array is read whole, and its {total} bytes are above "
                              f"max_record_bytes={limit} ({describe_bytes(limit)})"
                              + (" (it is compressed)" if _compressed(file.url) else f" and the file's {file.size}")
                              + "; save it in C order (np.ascontiguousarray) to have it read a chunk of rows at a time")
    array = _read_array(fh, shape[::-1], dtype, file).transpose()
    for index, start in enumerate(range(0, shape[0], shard_size)):
        yield Chunk(index, array[start:start + shard_size], start + 1)


def _compressed(url: str) -> bool:
    return url.lower().endswith(COMPRESSIONS)


def _read_array(fh, shape: tuple, dtype, file: InputFile):
    """A C-order array of ``shape`` filled from the stream a block at a time (no second copy of it)."""
    import numpy as np

    array = np.empty(shape, dtype=dtype)
    if not array.nbytes:
        return array
    flat = array.reshape(-1).view(np.uint8)  # a view: bytes written here land in the array
    got = 0
    while got < flat.size:
        part = fh.read(min(flat.size - got, NPY_BLOCK))
        if not part:
            raise PreprocessError(f"{file.url}: the .npy data is truncated ({got} of {flat.size} bytes of a chunk)")
        flat[got:got + len(part)] = np.frombuffer(part, np.uint8)
        got += len(part)
    return array
