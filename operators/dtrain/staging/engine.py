"""The staging loop: mirror every object under a source URL into a destination.

Imports no Airflow. ``stage()`` validates its inputs, lists the source (refusing unsafe
keys before anything is created in the destination), takes the destination's lock, scans
what is already there (removing stray temporary files of a killed stage), compares the
listing with the manifest (and the files present), copies what
changed (:mod:`dtrain.staging.copy`: retries, progress, cancellation, verification),
optionally deletes what vanished from the source, and writes the manifest last. This is
the one loop for every destination: a POSIX directory or any fsspec URL, whose
differences sit behind :class:`dtrain.staging.destination.Destination`; and for every
source client, behind :class:`dtrain.staging.sources.Source` (which imports botocore,
s3fs or other fsspec backends lazily, only when a stage runs).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Mapping

from dtrain.errors import DTrainError, SpecError
from dtrain.staging import manifest as M
from dtrain.staging import verify as V
from dtrain.staging.copy import Copier, CopyJob, Progress
from dtrain.staging.destination import Destination
from dtrain.staging.errors import StagingCancelled, StagingError
from dtrain.staging.fsspecdest import FsspecDestination
from dtrain.staging.lister import SourceObject
from dtrain.staging.posixdest import PosixDestination
from dtrain.staging.sources import Fetch, Source, open_source, redact_url, scrub, url_secrets

DEFAULT_WORKERS = 32
DEFAULT_PART_SIZE = 64 * 1024 * 1024
MIN_PART_SIZE = 256 * 1024

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
    from dtrain.args import coerce_int
    return coerce_int("workers", value, minimum=1, maximum=1024)


def open_destination(url: str, fsync: bool = True) -> Destination:
    """A POSIX directory for a path or a file:// or local:// URL (the same flock, symlink refusals
    and journal whichever way a local directory is named); any other URL is an fsspec destination."""
    for prefix in ("file://", "local://"):
        if url.startswith(prefix):
            if not url[len(prefix):]:  # abspath("") would be the working directory
                raise SpecError("destination", url, f"a directory path after {prefix}")
            return PosixDestination(url[len(prefix):], fsync=fsync)
    if "://" in url:
        return FsspecDestination(url)
    return PosixDestination(url, fsync=fsync)


def _check_arguments(source: Any, destination: Any, workers: Any, part_size: Any, verify: str,
                     progress_interval: Any) -> tuple[int, int, float]:
    """(workers, part size in bytes, seconds between progress lines); SpecError for anything wrong,
    before any I/O."""
    from dtrain.args import coerce_float

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
    # NaN or a negative interval would make the progress check always (or never) true.
    interval = coerce_float("progress_interval", progress_interval, minimum=0.0, maximum=86400.0)
    return workers, part_size, interval


@dataclass
class _Settings:
    """How one stage copies (the arguments of ``stage`` after validation)."""
    workers: int
    part_size: int
    verify: str
    retries: int
    delete: bool
    progress_interval: float
    log: logging.Logger
    cancel: threading.Event


def stage(source: str, destination: str, *, workers: Any = DEFAULT_WORKERS, part_size: Any = DEFAULT_PART_SIZE,
          delete: bool = False, storage_options: Mapping[str, Any] | None = None, verify: str = "auto",
          retries: int = 2, progress_interval: float = 10.0, fsync: bool = True,
          log: logging.Logger | None = None, cancel: threading.Event | None = None) -> StageResult:
    """Mirror ``source`` into ``destination``; see the module docstring. Returns a StageResult.

    Raises SpecError for bad arguments (before any I/O), UnsafeKeyError for a key that would
    escape the destination (before anything is copied), StagingError when the stage cannot
    complete, StagingCancelled when ``cancel`` is set. ``fsync`` applies to POSIX destinations;
    an fsspec destination has its store's own durability.
    """
    secrets = [x for url in (source, destination) if isinstance(url, str) for x in url_secrets(url)]
    with _clean_errors(secrets):
        workers, part_size, interval = _check_arguments(source, destination, workers, part_size, verify,
                                                        progress_interval)
        settings = _Settings(workers=workers, part_size=part_size, verify=verify, retries=retries, delete=delete,
                             progress_interval=interval, log=log or log_default,
                             cancel=cancel or threading.Event())
        dest = open_destination(destination.strip(), fsync=fsync)
        started = time.monotonic()
        src = open_source(source.strip(), storage_options, workers)
        try:
            # Listed first: a refused key is bad input, refused before anything exists in the destination.
            objects, fetcher = _list_and_build_reader(src)
            dest.prepare()
            with dest.lock():
                result = _sync(src, fetcher, objects, dest, redact_url(source), settings)
        finally:
            src.close()
        result.seconds = round(time.monotonic() - started, 3)
        settings.log.info("%s", result.summary())
        return result


@contextmanager
def _clean_errors(secrets: list[str]) -> Iterator[None]:
    """Every error leaves a stage as a DTrainError (the CLI prints one line, no traceback) that
    carries no secret of the source or destination URL. Libraries echo bucket names and request
    URLs in their messages, so the whole chain of causes is checked, and cut where it mentions a
    secret (a traceback, as Airflow logs one, would print it)."""
    try:
        yield
    except Exception as e:
        leaks = bool(secrets) and any(x in str(c) for c in _causes(e) for x in secrets)
        if isinstance(e, DTrainError):
            if leaks:
                e.args = (scrub(str(e), secrets),)
                e.__cause__ = e.__context__ = None
            raise
        if leaks or isinstance(e, OSError):
            raise StagingError(scrub(f"{type(e).__name__}: {e}", secrets)) from (None if leaks else e)
        raise


def _causes(e: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _sync(src: Source, fetcher: Fetch | None, objects: list[SourceObject], dest: Destination, source_name: str,
          s: _Settings) -> StageResult:
    """Diff the listing against the destination, copy what changed, write the manifest last."""
    on_disk = dest.scan()
    known = dest.load()
    fetch, skip, gone = diff(objects, known, on_disk)
    deleted = _delete_gone(dest, gone, s) if gone else 0
    s.log.info("staging %s -> %s: %d objects, %d to fetch (%.1f MB), %d unchanged",
               src.name, dest.name, len(objects), len(fetch), sum(o.size for o in fetch) / 1e6, len(skip))
    entries = {o.rel: known[o.rel] for o in skip}
    copy_started = time.monotonic()
    new = _copy(src, fetcher, dest, fetch, s) if fetch else {}
    entries.update(new)
    copy_seconds = time.monotonic() - copy_started
    if fetch or deleted or gone or set(known) != set(entries) or dest.needs_manifest():
        dest.write_manifest(source_name, entries)
    fetched_bytes = sum(entry.size for entry in new.values())
    return StageResult(
        source=source_name, destination=dest.name, manifest_path=dest.manifest_path,
        files_total=len(objects), bytes_total=sum(o.size for o in objects), fetched=len(fetch),
        skipped=len(skip), deleted=deleted, gone=gone, bytes_fetched=fetched_bytes,
        mb_per_s=round(fetched_bytes / 1e6 / copy_seconds, 6) if fetched_bytes and copy_seconds > 0 else 0.0)


def _list_and_build_reader(src: Source) -> tuple[list[SourceObject], Fetch | None]:
    """The listing, and the reader built meanwhile (a botocore client costs ~0.2 s of CPU, which
    then overlaps the listing's wait on the network)."""
    box: list[Fetch] = []
    builder = threading.Thread(target=lambda: box.append(src.fetcher()), name="dtrain-stage-client", daemon=True)
    builder.start()
    try:
        objects = src.list()
    finally:
        builder.join()
    return objects, (box[0] if box else None)  # None: built again (raising its error) only if needed


def _delete_gone(dest: Destination, gone: list[str], s: _Settings) -> int:
    if not s.delete:
        s.log.info("%d file(s) in the destination are no longer in the source (kept; use delete to remove): %s",
                   len(gone), ", ".join(gone[:10]) + (" ..." if len(gone) > 10 else ""))
        return 0
    removed = dest.remove(gone)
    if removed:
        s.log.info("deleted %d file(s) no longer in the source", removed)
    return removed


def _copy(src: Source, fetcher: Fetch | None, dest: Destination, objects: list[SourceObject],
          s: _Settings) -> dict[str, M.Entry]:
    """Copy ``objects`` into ``dest``; returns their manifest entries or raises for any failure."""
    dest.make_dirs(o.rel for o in objects)
    jobs = plan_jobs(src, objects, s.verify, s.workers)
    progress = Progress(len(objects), sum(o.size for o in objects), s.log, s.progress_interval)
    journal = dest.open_journal()
    try:
        copier = Copier(fetcher or src.fetcher(), jobs, destination=dest, workers=s.workers, part_size=s.part_size,
                        retries=s.retries, journal=journal, progress=progress, cancel=s.cancel, log=s.log)
        new, failures = copier.run()
    finally:
        if journal is not None:
            journal.close()
    if failures:
        _raise_failures(failures, s.cancel)
    dest.settle(new)
    return new


def _raise_failures(failures: dict[str, BaseException], cancel: threading.Event) -> None:
    if cancel.is_set():
        raise StagingCancelled("stage cancelled; files that landed are kept and a rerun resumes")
    names = sorted(failures)
    first = failures[names[0]]
    detail = "; ".join(f"{n}: {type(failures[n]).__name__}: {failures[n]}" for n in names[:5])
    raise StagingError(f"{len(names)} file(s) failed to stage (rerun resumes): {detail}") from first


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


def plan_jobs(src: Source, objects: list[SourceObject], verify: str, workers: int) -> list[CopyJob]:
    """One CopyJob per object, with its verification plan.

    Multipart objects need one HEAD each (part size, stored checksum); those run in parallel.
    """
    heads: dict[str, tuple[int | None, tuple[str, str] | None]] = {}
    multipart = [o for o in objects if o.multipart and verify != "size"]
    if multipart:
        with ThreadPoolExecutor(max_workers=min(workers, 32)) as pool:
            for obj, head in zip(multipart, pool.map(lambda o: _head_part(src, o), multipart)):
                heads[obj.rel] = head
    jobs = []
    for obj in objects:
        part_size, stored = heads.get(obj.rel, (None, None))
        jobs.append(CopyJob(obj=obj, plan=V.plan_verify(obj.size, obj.etag, verify, part_size, stored)))
    return jobs


def _head_part(src: Source, obj: SourceObject) -> tuple[int | None, tuple[str, str] | None]:
    """(part size of a multipart upload, stored full-object checksum) for a multipart object.

    A stored full-object checksum (CRC32 by default in current SDKs) is used when present: it
    covers every byte and costs a sixth of MD5. Otherwise ``HEAD ?partNumber=1`` gives the size
    of part 1 (every part but the last shares it), from which the multipart ETag is recomputed
    exactly (MD5 of every byte): large objects are multipart, so the default verifies them too.
    Only a store that answers neither leaves size + a recorded fingerprint.
    """
    try:
        head = src.head(obj)
        # Only an explicit FULL_OBJECT checksum covers the content as one stream; composite
        # checksums (and stores that do not say which kind they keep) are not used.
        if head.etag == obj.etag and head.checksum_type == "FULL_OBJECT":
            for algo in V.CHECKSUM_ALGOS:
                value = head.checksums.get(algo)
                if value and "-" not in value:
                    return None, (algo, value)
    except Exception:  # noqa: BLE001 - try the part size next
        pass
    try:
        part_size = src.head(obj, part_number=1).size
        if part_size and V.plan_verify(obj.size, obj.etag, "auto", part_size).kind == "mpu":
            return part_size, None
    except Exception:  # noqa: BLE001 - a store without partNumber support
        pass
    return None, None
