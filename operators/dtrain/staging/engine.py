"""The sync engine: mirror every object under a source fsspec URL into a destination directory.

Imports no Airflow. ``stage()`` validates its inputs, takes an exclusive lock on the
destination, removes stray temporary files of a killed stage, lists the source,
compares the listing with the manifest (and the files on disk), copies what changed
(:mod:`operators.staging.copy`), optionally deletes what vanished from the source,
and writes the manifest last. Sources (:mod:`operators.staging.sources`) import
botocore, s3fs or other fsspec backends lazily, only when a stage runs.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from operators.errors import SpecError
from operators.staging import manifest as M
from operators.staging import verify as V
from operators.staging.copy import Copier, CopyJob, Progress
from operators.staging.errors import StagingCancelled, StagingError
from operators.staging.lister import SourceObject

DEFAULT_WORKERS = 32
DEFAULT_PART_SIZE = 64 * 1024 * 1024
MIN_PART_SIZE = 256 * 1024
RESERVED_NAMES = (M.MANIFEST_NAME, M.JOURNAL_NAME, M.LOCK_NAME)

log_default = logging.getLogger("dtrain.staging")


@dataclass
class StageResult:
    source: str
    destination: str
    manifest_path: str
    files_total: int
    bytes_total: int
    fetched: int
    skipped: int
    deleted: int
    gone: list[str] = field(default_factory=list)   # in the destination but no longer in the source
    bytes_fetched: int = 0
    seconds: float = 0.0
    mb_per_s: float = 0.0                            # bytes fetched / copy seconds, in MB/s (1e6)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gone_count"] = len(self.gone)
        d["gone"] = self.gone[:100]  # keep XCom small
        return d

    def summary(self) -> str:
        return (f"staged {self.source} -> {self.destination}: fetched {self.fetched}, skipped {self.skipped}, "
                f"deleted {self.deleted}, gone from source {len(self.gone)}, {self.bytes_fetched / 1e6:.1f} MB "
                f"in {self.seconds:.2f} s, {self.mb_per_s:.1f} MB/s")


def redact_url(url: str) -> str:
    """A URL fit for logs: user:password@ removed."""
    return re.sub(r"(?<=://)[^/@]*@", "", url)


def parse_size(field_name: str, value: Any) -> int:
    """Bytes from 123, "64MiB", "16MB", "1.5GiB", "100GB" (decimal for MB/GB, binary for MiB/GiB)."""
    if isinstance(value, bool):
        raise SpecError(field_name, value, "a size such as 16MiB, 100GB or a number of bytes")
    if isinstance(value, (int, float)):
        if value < 0:
            raise SpecError(field_name, value, "a size must not be negative")
        return int(value)
    units = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3, "GB": 1000**3,
             "T": 1000**4, "TB": 1000**4, "P": 1000**5, "PB": 1000**5, "KIB": 1024, "MIB": 1024**2,
             "GIB": 1024**3, "TIB": 1024**4, "PIB": 1024**5}
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in units:
        raise SpecError(field_name, value, "a size such as 16MiB, 100GB, 1.2TiB or a number of bytes")
    return int(float(m.group(1)) * units[m.group(2).upper()])


def _coerce_workers(value: Any) -> int:
    from operators.launch.spec import coerce_int
    return coerce_int("workers", value, minimum=1, maximum=1024)


def _local_path(url: str) -> str | None:
    """The POSIX path of a destination, or None when it is a non-local fsspec URL."""
    if url.startswith("file://"):
        return url[len("file://"):]
    if "://" in url:
        return None
    return url


def stage(source: str, destination: str, *, workers: Any = DEFAULT_WORKERS, part_size: Any = DEFAULT_PART_SIZE,
          delete: bool = False, storage_options: Mapping[str, Any] | None = None, verify: str = "auto",
          retries: int = 2, progress_interval: float = 10.0, fsync: bool = True,
          log: logging.Logger | None = None, cancel: threading.Event | None = None) -> StageResult:
    """Mirror ``source`` into ``destination``; see the module docstring. Returns a StageResult.

    Raises SpecError for bad arguments (before any I/O), UnsafeKeyError for a key that would
    escape the destination (before anything is copied), StagingError when the stage cannot
    complete, StagingCancelled when ``cancel`` is set.
    """
    log = log or log_default
    cancel = cancel or threading.Event()
    if not isinstance(source, str) or not source.strip():
        raise SpecError("source", source, "a non-empty URL such as s3://bucket/prefix/ or a local path")
    if not isinstance(destination, str) or not destination.strip():
        raise SpecError("destination", destination, "a non-empty directory path on the shared filesystem")
    workers = _coerce_workers(workers)
    part_size = parse_size("part_size", part_size)
    if part_size < MIN_PART_SIZE:
        raise SpecError("part_size", part_size, f"at least {MIN_PART_SIZE} bytes")
    if verify not in V.VERIFY_MODES:
        raise SpecError("verify", verify, f"one of {', '.join(V.VERIFY_MODES)}")
    dest = _local_path(destination.strip())
    if dest is None:
        from operators.staging.remote import stage_to_fsspec
        return stage_to_fsspec(source.strip(), destination.strip(), workers=workers, part_size=part_size,
                               delete=delete, storage_options=storage_options, verify=verify,
                               log=log, cancel=cancel)
    dest = os.path.abspath(dest)
    started = time.monotonic()
    from operators.staging.sources import open_source
    src = open_source(source.strip(), storage_options, workers)
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as e:
        raise StagingError(f"cannot create destination {dest!r}: {e}") from e
    with DestinationLock(dest):
        on_disk = scan_destination(dest)
        known = M.load(dest)
        # Build the reader (botocore client: ~0.2 s of CPU) while the listing waits on the network.
        fetcher_box: list = []
        builder = threading.Thread(target=lambda: fetcher_box.append(src.fetcher()),
                                   name="dtrain-stage-client", daemon=True)
        builder.start()
        try:
            objects = src.list()
        finally:
            builder.join()
        fetch, skip, gone = diff(objects, known, on_disk)
        deleted = remove_gone(dest, gone, log) if delete else 0
        if gone and not delete:
            log.info("%d file(s) in the destination are no longer in the source (kept; use delete to remove): %s",
                     len(gone), ", ".join(gone[:10]) + (" ..." if len(gone) > 10 else ""))
        log.info("staging %s -> %s: %d objects, %d to fetch (%.1f MB), %d unchanged",
                 redact_url(source), dest, len(objects), len(fetch), sum(o.size for o in fetch) / 1e6, len(skip))
        entries = {o.rel: known[o.rel] for o in skip}
        copy_started = time.monotonic()
        fetched_bytes = 0
        if fetch:
            new = _copy(src, fetcher_box[0] if fetcher_box else None, dest, fetch, workers=workers,
                        part_size=part_size, verify=verify, retries=retries, fsync=fsync, log=log,
                        cancel=cancel, progress_interval=progress_interval)
            entries.update(new)
            fetched_bytes = sum(entry.size for entry in new.values())
        copy_seconds = time.monotonic() - copy_started
        manifest_path = os.path.join(dest, M.MANIFEST_NAME)
        journal_left = os.path.exists(os.path.join(dest, M.JOURNAL_NAME))
        if fetch or deleted or gone or journal_left or not os.path.exists(manifest_path) or set(known) != set(entries):
            M.write(dest, redact_url(source), entries)
        if journal_left or fetch:
            M.Journal(dest).remove()
    seconds = time.monotonic() - started
    result = StageResult(
        source=redact_url(source), destination=dest, manifest_path=manifest_path,
        files_total=len(objects), bytes_total=sum(o.size for o in objects), fetched=len(fetch),
        skipped=len(skip), deleted=deleted, gone=gone, bytes_fetched=fetched_bytes, seconds=round(seconds, 3),
        mb_per_s=round(fetched_bytes / 1e6 / copy_seconds, 6) if fetched_bytes and copy_seconds > 0 else 0.0)
    log.info("%s", result.summary())
    return result


def _copy(src: Any, fetcher: Any, dest: str, objects: list[SourceObject], *, workers: int, part_size: int,
          verify: str, retries: int, fsync: bool, log: logging.Logger, cancel: threading.Event,
          progress_interval: float) -> dict[str, M.Entry]:
    """Copy ``objects`` into ``dest``; returns their manifest entries or raises for any failure."""
    _make_dirs(dest, objects)
    jobs = plan_jobs(src.head_func(), dest, objects, verify, workers)
    progress = Progress(len(objects), sum(o.size for o in objects), log, progress_interval)
    journal = M.Journal(dest)
    try:
        copier = Copier(fetcher or src.fetcher(), jobs, workers=workers, part_size=part_size, retries=retries,
                        journal=journal, progress=progress, cancel=cancel, log=log, fsync=fsync, dest=dest)
        new, failures = copier.run()
    finally:
        journal.close()
    if failures:
        _raise_failures(failures, cancel)
    for directory in {os.path.dirname(j.final) for j in jobs}:
        M.fsync_dir(directory)  # the renames themselves, before the manifest claims them
    return new


def _raise_failures(failures: dict[str, BaseException], cancel: threading.Event) -> None:
    if cancel.is_set():
        raise StagingCancelled("stage cancelled; files that landed are kept and a rerun resumes")
    names = sorted(failures)
    first = failures[names[0]]
    detail = "; ".join(f"{n}: {type(failures[n]).__name__}: {failures[n]}" for n in names[:5])
    raise StagingError(f"{len(names)} file(s) failed to stage (rerun resumes): {detail}") from first


class DestinationLock:
    """An exclusive flock on the destination: two stages never write one directory at once.

    The kernel drops the lock when its holder dies (even by SIGKILL), so a rerun never waits
    on a dead stage.
    """

    def __init__(self, dest: str):
        self.path = os.path.join(dest, M.LOCK_NAME)
        self.fd = -1

    def __enter__(self) -> "DestinationLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(self.fd)
            raise StagingError(f"another stage is writing to {os.path.dirname(self.path)!r} right now") from e
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def scan_destination(dest: str) -> dict[str, int]:
    """Relative path -> size of every regular file under ``dest``; stray temp files are removed.

    Temporary files can only be strays: the destination lock is held, so no stage is writing.
    """
    found: dict[str, int] = {}
    stack = [("", dest)]
    while stack:
        rel_dir, path = stack.pop()
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            continue
        for entry in entries:
            rel = f"{rel_dir}{entry.name}"
            if entry.name.startswith(M.TMP_PREFIX):
                _remove_stray(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                stack.append((rel + "/", entry.path))
            elif not (rel_dir == "" and entry.name in RESERVED_NAMES) and entry.is_file(follow_symlinks=False):
                found[rel] = entry.stat(follow_symlinks=False).st_size
    return found


def _remove_stray(path: str) -> None:
    try:
        os.unlink(path)
    except (FileNotFoundError, IsADirectoryError):
        pass


def diff(objects: list[SourceObject], known: Mapping[str, M.Entry], on_disk: Mapping[str, int]
         ) -> tuple[list[SourceObject], list[SourceObject], list[str]]:
    """(to fetch, unchanged, gone from the source).

    Unchanged means: the manifest has the same size and change token (ETag/version/mtime) AND
    a file of that size stands at the final path. Nothing is read from the source for it.
    """
    fetch, skip = [], []
    for obj in objects:
        entry = known.get(obj.rel)
        if (entry is not None and entry.size == obj.size and entry.token == obj.token
                and on_disk.get(obj.rel) == obj.size):
            skip.append(obj)
        else:
            fetch.append(obj)
    names = {o.rel for o in objects}
    gone = sorted(rel for rel in on_disk if rel not in names)
    return fetch, skip, gone


def remove_gone(dest: str, gone: list[str], log: logging.Logger) -> int:
    removed = 0
    for rel in gone:
        path = os.path.join(dest, rel)
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            continue
        parent = os.path.dirname(path)
        while parent != dest:  # prune directories the deletion emptied
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)
    if removed:
        log.info("deleted %d file(s) no longer in the source", removed)
    return removed


def _make_dirs(dest: str, objects: list[SourceObject]) -> None:
    """Create every directory the copy needs, refusing any that resolves outside ``dest``.

    Keys were already checked for ``..`` and absolute paths; this also stops a symlinked
    directory inside the destination from sending writes elsewhere.
    """
    real_dest = os.path.realpath(dest)
    for rel_dir in sorted({os.path.dirname(o.rel) for o in objects}):
        path = os.path.join(dest, rel_dir) if rel_dir else dest
        try:
            os.makedirs(path, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:
            raise StagingError(f"destination {path!r} is a file where the source has a directory; "
                               f"remove it or stage with delete=True") from e
        real = os.path.realpath(path)
        if real != real_dest and not real.startswith(real_dest + os.sep):
            raise StagingError(f"destination directory {path!r} resolves outside the destination ({real!r}); refusing")


def plan_jobs(head: Any, dest: str, objects: list[SourceObject], verify: str, workers: int) -> list[CopyJob]:
    """One CopyJob per object, with its verification plan.

    Multipart objects need one HEAD each (part size, stored checksum); those run in parallel.
    """
    heads: dict[str, tuple[int | None, tuple[str, str] | None]] = {}
    multipart = [o for o in objects if o.multipart and verify != "size"]
    if multipart and head is not None:
        with ThreadPoolExecutor(max_workers=min(workers, 32)) as pool:
            for obj, head in zip(multipart, pool.map(lambda o: _head_part(head, o, verify == "strict"), multipart)):
                heads[obj.rel] = head
    jobs = []
    for obj in objects:
        part_size, stored = heads.get(obj.rel, (None, None))
        plan = V.plan_verify(obj.size, obj.etag, verify, part_size, stored)
        jobs.append(CopyJob(obj=obj, final=os.path.join(dest, obj.rel), plan=plan))
    return jobs


def _head_part(head_object: Any, obj: SourceObject, strict: bool) -> tuple[int | None, tuple[str, str] | None]:
    """(part size of a multipart upload, stored full-object checksum) for a multipart object.

    A stored full-object checksum (CRC32 by default in current SDKs) is used when present: it
    covers every byte and costs a sixth of MD5. Otherwise, with ``verify="strict"``,
    ``HEAD ?partNumber=1`` gives the size of part 1 (every part but the last shares it), from
    which the multipart ETag is recomputed exactly (MD5 of every byte). Otherwise: size + a
    recorded fingerprint.
    """
    bucket, _, key = obj.path.partition("/")
    try:
        head = head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        # Only an explicit FULL_OBJECT checksum covers the content as one stream; composite
        # checksums (and stores that do not say which kind they keep) are not used.
        if head.get("ETag", "").strip('"') == obj.etag and head.get("ChecksumType") == "FULL_OBJECT":
            for algo in V.CHECKSUM_ALGOS:
                value = head.get(f"Checksum{algo.upper()}")
                if value and "-" not in value:
                    return None, (algo, value)
    except Exception:  # noqa: BLE001 - try the part size next
        pass
    if not strict:
        return None, None
    try:
        head = head_object(Bucket=bucket, Key=key, PartNumber=1)
        part_size = int(head.get("ContentLength") or 0)
        if part_size and V.plan_verify(obj.size, obj.etag, "auto", part_size).kind == "mpu":
            return part_size, None
    except Exception:  # noqa: BLE001 - a store without partNumber support
        pass
    return None, None
