"""The copy half of the staging loop: files in parallel, large files in ranged parts, any destination.

Each file is written into a temporary file of the destination (:mod:`dtrain.staging.destination`),
every part is hashed as it lands, the result is verified, made durable as the destination
requires and only then moved to its final name. A failed file is refetched (``retries``),
a dropped range resumes where it stopped, progress is logged at intervals and ``cancel``
stops every worker. A reader never sees a partial file at a final path.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from dtrain.staging import verify as V
from dtrain.staging.destination import Destination, TempFile
from dtrain.staging.errors import StagingCancelled, StagingError, VerifyError
from dtrain.staging.lister import SourceObject
from dtrain.staging.manifest import Entry, Journal
from dtrain.staging.s3read import SourceChanged
from dtrain.staging.sources import Fetch

BATCH = 64            # verified files made durable by one syncfs
BATCH_SECONDS = 0.25  # ... or after this long, so renames (and resumability) keep pace

# Errors worth a retry of the same request; missing objects and denied access are not.
_FATAL = (FileNotFoundError, PermissionError, StagingCancelled, SourceChanged)


@dataclass
class CopyJob:
    obj: SourceObject
    plan: V.VerifyPlan
    chunks: list[tuple[int, int]] = field(default_factory=list)  # fetch ranges [start, end)
    attempts: int = 0
    # per-attempt state
    remaining: int = 0
    file: TempFile | None = None
    error: BaseException | None = None
    hashers: list[V.SegmentHasher] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def split(self, part_size: int | None) -> None:
        """Fetch ranges of ``part_size`` (None: one range) over the whole object, independent of
        the hash segments (a range may feed several multipart segments; each gets its own slice)."""
        self.chunks = []
        pos = 0
        while True:
            stop = self.obj.size if part_size is None else min(self.obj.size, pos + part_size)
            self.chunks.append((pos, stop))
            pos = stop
            if pos >= self.obj.size:
                break

    def reset(self) -> None:
        self.remaining = len(self.chunks)
        self.file, self.error = None, None
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
    """Runs copy jobs on ``workers`` threads; parts of one file are spread over the threads
    where the destination takes writes at any offset."""

    def __init__(self, fetch: Fetch, jobs: list[CopyJob], *, destination: Destination, workers: int,
                 part_size: int, retries: int, journal: Journal | None, progress: Progress,
                 cancel: threading.Event, log: logging.Logger):
        self.fetch = fetch
        self.jobs = jobs
        self.dest = destination
        self.workers = workers
        # A destination without ranged writes gets each file as one range, streamed in order.
        self.part_size = part_size if destination.ranged_writes else None
        self.retries = retries
        self.journal = journal
        self.progress = progress
        self.cancel = cancel
        self.log = log
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
        """Make a batch of verified temp files durable at once (syncfs), then move them into place."""
        self.dest.sync([job.file for job, _ in batch])
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
        file = self._open(job)
        pos, delay, attempt = start, 0.2, 0
        while pos < end:
            if self.cancel.is_set():
                raise StagingCancelled("stage cancelled")
            try:
                for block in self.fetch(job.obj, pos, end):
                    if self.cancel.is_set():  # a range may be a whole file: stop mid-range, not after it
                        raise StagingCancelled("stage cancelled")
                    if pos + len(block) > end:
                        raise VerifyError(f"{job.obj.rel}: the store sent more than bytes {start}-{end}")
                    self._write(job, file, pos, block)
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

    def _write(self, job: CopyJob, file: TempFile, pos: int, block) -> None:
        file.write(pos, block)
        end = pos + len(block)
        for hasher, (seg_start, seg_end) in zip(job.hashers, job.plan.segments):
            lo, hi = max(pos, seg_start), min(end, seg_end)
            if lo < hi:
                hasher.add(lo, hi, memoryview(block)[lo - pos:hi - pos], file.read)
        self.progress.add_bytes(len(block))

    def _open(self, job: CopyJob) -> TempFile:
        with job.lock:
            if job.file is None:
                job.file = self.dest.create(job.obj.rel, job.obj.size, len(job.chunks))
            return job.file

    def _finish(self, job: CopyJob) -> None:
        error = job.error
        checksum = None
        try:
            if error is None:
                checksum = V.finish(job.plan, job.hashers, job.obj.rel)
                if job.file.size() != job.obj.size:
                    raise VerifyError(f"{job.obj.rel}: file size differs from the object's size {job.obj.size}")
                job.file.close()
        except BaseException as e:  # noqa: BLE001
            error = e
        if error is not None:
            if job.file is not None:
                job.file.discard()
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
        if self.dest.batched:
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
        """Move a verified (and durable) temp file to its final name and record it."""
        try:
            job.file.land()
        except Exception as e:  # noqa: BLE001 - any store's failure; an escape would hang run()
            job.file.discard()
            with self._cond:
                self.failures[job.obj.rel] = StagingError(f"{job.obj.rel}: cannot move into place at "
                                                          f"{job.file.final}: {e}")
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

