"""Parallel copy into a local (POSIX) destination: files in parallel, large files in ranged parts.

Each file is written with ``os.pwrite`` into a hidden temporary file created in its
final directory (preallocated to the object's size), every part is hashed as it
lands, the result is verified, fsynced and only then renamed to its final name.
A reader therefore never sees a partial file at a final path, even if the process
is killed with SIGKILL; the next stage removes the stray temporary files.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

from operators.staging import verify as V
from operators.staging.errors import StagingCancelled, StagingError, VerifyError
from operators.staging.lister import SourceObject
from operators.staging.manifest import TMP_PREFIX, Entry, Journal
from operators.staging.s3read import SourceChanged

BATCH = 64            # verified files made durable by one syncfs
BATCH_SECONDS = 0.25  # ... or after this long, so renames (and resumability) keep pace

# Errors worth a retry of the same request; missing objects and denied access are not.
_FATAL = (FileNotFoundError, PermissionError, StagingCancelled, SourceChanged)


@dataclass
class CopyJob:
    obj: SourceObject
    final: str
    plan: V.VerifyPlan
    chunks: list[tuple[int, int]] = field(default_factory=list)  # fetch ranges [start, end)
    attempts: int = 0
    # per-attempt state
    remaining: int = 0
    fd: int = -1
    tmp: str = ""
    error: BaseException | None = None
    hashers: list[V.SegmentHasher] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def split(self, part_size: int) -> None:
        """Fetch ranges of ``part_size`` over the whole object, independent of the hash segments
        (a range may feed several multipart segments; each gets its own slice)."""
        self.chunks = []
        pos = 0
        while True:
            stop = min(self.obj.size, pos + part_size)
            self.chunks.append((pos, stop))
            pos = stop
            if pos >= self.obj.size:
                break

    def reset(self) -> None:
        self.remaining = len(self.chunks)
        self.fd, self.tmp, self.error = -1, "", None
        self.hashers = ([] if self.plan.kind == "size" else
                        [V.SegmentHasher(s, e, self.plan.algo) for s, e in self.plan.segments])


class Progress:
    """Counters shared by the workers; the stage's main thread logs them at intervals."""

    def __init__(self, files: int, nbytes: int, log: logging.Logger, interval: float):
        self.files_total, self.bytes_total = files, nbytes
        self.files_done = self.bytes_done = 0
        self.log, self.interval = log, interval
        self.start = time.monotonic()
        self._next = self.start + interval
        self._lock = threading.Lock()

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_done += n

    def add_file(self) -> None:
        with self._lock:
            self.files_done += 1

    def rate(self) -> float:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        return self.bytes_done / elapsed

    def maybe_log(self) -> None:
        now = time.monotonic()
        if self.interval <= 0 or now < self._next:
            return
        self._next = now + self.interval
        rate = self.rate()
        left = self.bytes_total - self.bytes_done
        eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
        self.log.info("staging progress: %d/%d files, %.1f/%.1f MB, %.1f MB/s, ETA %s",
                      self.files_done, self.files_total, self.bytes_done / 1e6, self.bytes_total / 1e6,
                      rate / 1e6, eta)


class Copier:
    """Runs copy jobs on ``workers`` threads; parts of one file are spread over the threads."""

    def __init__(self, fetch: Callable[[SourceObject, int, int], Iterable[bytes]], jobs: list[CopyJob], *, workers: int,
                 part_size: int, retries: int, journal: Journal | None, progress: Progress,
                 cancel: threading.Event, log: logging.Logger, fsync: bool = True, dest: str | None = None):
        self.fetch = fetch
        self.jobs = jobs
        self.workers = workers
        self.part_size = part_size
        self.retries = retries
        self.journal = journal
        self.progress = progress
        self.cancel = cancel
        self.log = log
        # Durability before rename. "batch": one syncfs(2) for up to BATCH verified files, then
        # their renames (one journal commit instead of one per file); "file": fsync each file;
        # "none": rely on the page cache (survives kill -9, not a power cut).
        self.syncfs = _syncfs() if fsync and dest else None
        self.durability = "none" if not fsync else ("batch" if self.syncfs else "file")
        self.dest = dest
        self._ready: list[tuple[CopyJob, str | None]] = []
        self._ready_since = 0.0
        self._finished = 0
        self.queue: queue.Queue = queue.Queue()
        self.entries: dict[str, Entry] = {}
        self.failures: dict[str, BaseException] = {}
        self._done = 0
        self._cond = threading.Condition()

    def run(self) -> tuple[dict[str, Entry], dict[str, BaseException]]:
        # Largest first: their parts spread over every thread while small files fill the gaps.
        for job in sorted(self.jobs, key=lambda j: -j.obj.size):
            job.split(self.part_size)
            self._enqueue(job)
        threads = [threading.Thread(target=self._worker, name=f"dtrain-stage-{i}", daemon=True)
                   for i in range(min(self.workers, max(1, sum(len(j.chunks) for j in self.jobs))))]
        for t in threads:
            t.start()
        try:
            with self._cond:
                while self._done < len(self.jobs):
                    self._cond.wait(timeout=0.1)
                    self.progress.maybe_log()
                    if self._ready and (len(self._ready) >= BATCH or self._finished == len(self.jobs)
                                        or time.monotonic() - self._ready_since > BATCH_SECONDS):
                        batch, self._ready = self._ready, []
                        self._cond.release()  # workers keep finishing files while this batch syncs
                        try:
                            self._commit(batch)
                        finally:
                            self._cond.acquire()
        finally:
            for _ in threads:
                self.queue.put(None)
            for t in threads:
                t.join()
            if self._ready:  # cancelled or failed mid-way: what was verified still lands
                batch, self._ready = self._ready, []
                self._commit(batch)
        return self.entries, self.failures

    def _commit(self, batch: list[tuple[CopyJob, str | None]]) -> None:
        """Make a batch of verified temp files durable with one syncfs, then rename them."""
        fd = os.open(self.dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if self.syncfs(fd) != 0:
                for job, _ in batch:  # syncfs refused: fall back to per-file fsync
                    _fsync_path(job.tmp)
        finally:
            os.close(fd)
        for job, checksum in batch:
            self._land(job, checksum)

    def _enqueue(self, job: CopyJob) -> None:
        job.reset()
        for index in range(len(job.chunks)):
            self.queue.put((job, index))

    def _worker(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            job, index = item
            try:
                if job.error is None:
                    self._copy_chunk(job, index)
            except BaseException as e:  # noqa: BLE001 - recorded, retried or reported by _finish
                with job.lock:
                    if job.error is None:
                        job.error = e
            with job.lock:
                job.remaining -= 1
                last = job.remaining == 0
            if last:
                self._finish(job)

    def _copy_chunk(self, job: CopyJob, index: int) -> None:
        """Stream one range into the temp file block by block; resume the range after a
        dropped connection instead of starting it over."""
        start, end = job.chunks[index]
        fd = self._open(job)
        pos, delay, attempt = start, 0.2, 0
        while pos < end:
            if self.cancel.is_set():
                raise StagingCancelled("stage cancelled")
            try:
                for block in self.fetch(job.obj, pos, end):
                    if pos + len(block) > end:
                        raise VerifyError(f"{job.obj.rel}: the store sent more than bytes {start}-{end}")
                    self._write(job, fd, pos, block)
                    pos += len(block)
                if pos < end:
                    raise VerifyError(f"{job.obj.rel}: short download, bytes {pos}-{end} missing")
            except _FATAL:
                raise
            except Exception as e:  # dropped connection, short body, throttling: resume this range
                attempt += 1
                if attempt > 3:
                    raise
                self.log.debug("resuming %s at byte %d after %s: %s", job.obj.rel, pos, type(e).__name__, e)
                time.sleep(delay)
                delay *= 2

    def _write(self, job: CopyJob, fd: int, pos: int, block) -> None:
        view = memoryview(block)
        offset = pos
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
        end = pos + len(block)
        for hasher, (seg_start, seg_end) in zip(job.hashers, job.plan.segments):
            lo, hi = max(pos, seg_start), min(end, seg_end)
            if lo < hi:
                hasher.add(lo, hi, memoryview(block)[lo - pos:hi - pos], fd)
        self.progress.add_bytes(len(block))

    def _open(self, job: CopyJob) -> int:
        with job.lock:
            if job.fd < 0:
                directory = os.path.dirname(job.final)
                job.tmp = os.path.join(directory, f"{TMP_PREFIX}{uuid.uuid4().hex[:16]}")
                job.fd = os.open(job.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                if len(job.chunks) > 1:
                    _preallocate(job.fd, job.obj.size)
            return job.fd

    def _finish(self, job: CopyJob) -> None:
        error = job.error
        checksum = None
        try:
            if error is None:
                checksum = V.finish(job.plan, job.hashers, job.obj.rel)
                if os.fstat(job.fd).st_size != job.obj.size:
                    raise VerifyError(f"{job.obj.rel}: file size differs from the object's size {job.obj.size}")
                if self.durability == "file":
                    os.fsync(job.fd)
        except BaseException as e:  # noqa: BLE001
            error = e
        if job.fd >= 0:
            os.close(job.fd)
            job.fd = -1
        if error is not None:
            _unlink(job.tmp)
            job.attempts += 1
            retry = (job.attempts <= self.retries and not isinstance(error, _FATAL)
                     and not self.cancel.is_set())
            if retry:
                self.log.warning("refetching %s after: %s", job.obj.rel, error)
                self._enqueue(job)
                return
            with self._cond:
                self.failures[job.obj.rel] = error
                self._finished += 1
                self._done += 1
                self._cond.notify()
            return
        if self.durability == "batch":
            with self._cond:
                if not self._ready:
                    self._ready_since = time.monotonic()
                self._ready.append((job, checksum))
                self._finished += 1
                self._cond.notify()
            return
        with self._cond:
            self._finished += 1
        self._land(job, checksum)

    def _land(self, job: CopyJob, checksum: str | None) -> None:
        """Rename a verified (and durable) temp file to its final name and record it."""
        try:
            os.rename(job.tmp, job.final)
        except OSError as e:
            _unlink(job.tmp)
            with self._cond:
                self.failures[job.obj.rel] = StagingError(f"{job.obj.rel}: cannot move into place at {job.final}: {e}")
                self._done += 1
                self._cond.notify()
            return
        entry = Entry(size=job.obj.size, token=job.obj.token, etag=job.obj.etag,
                      version_id=job.obj.version_id, checksum=checksum)
        if self.journal is not None:
            self.journal.append(job.obj.rel, entry)
        self.progress.add_file()
        with self._cond:
            self.entries[job.obj.rel] = entry
            self._done += 1
            self._cond.notify()


def _syncfs():
    """libc's syncfs(2) (Linux), or None."""
    try:
        import ctypes

        func = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int]
    func.restype = ctypes.c_int
    return func


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _preallocate(fd: int, size: int) -> None:
    """Reserve the blocks up front (fewer fragments, ENOSPC early); fall back to a sparse size."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.ftruncate(fd, size)


def _unlink(path: str) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
