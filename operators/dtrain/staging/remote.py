"""Staging into a non-POSIX destination given as an fsspec URL (memory://, s3://, gcs://...).

The shared filesystem is normally a POSIX mount and takes the fast path in
:mod:`operators.staging.copy`. Here files are still copied in parallel, each one
streamed in order into a hidden temporary name, verified, then moved to its final
name (as atomic as the target store allows); the manifest is written last.
"""

from __future__ import annotations

import json
import logging
import posixpath
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, Mapping

from operators.staging import manifest as M
from operators.staging import verify as V
from operators.staging.errors import StagingCancelled, StagingError, VerifyError


def stage_to_fsspec(source: str, destination: str, *, workers: int, part_size: int, delete: bool,
                    storage_options: Mapping[str, Any] | None, verify: str, log: logging.Logger,
                    cancel: threading.Event):
    import fsspec.core

    from operators.staging.engine import StageResult, diff, plan_jobs, redact_url
    from operators.staging.sources import open_source

    started = time.monotonic()
    src = open_source(source, storage_options, workers)
    fetch = src.fetcher()
    dfs, droot = fsspec.core.url_to_fs(destination)
    droot = droot.rstrip("/")
    dfs.makedirs(droot, exist_ok=True)
    on_disk: dict[str, int] = {}
    for path, info in dfs.find(droot, detail=True, withdirs=False).items():
        rel = path[len(droot) + 1:]
        if posixpath.basename(rel).startswith(M.TMP_PREFIX):
            dfs.rm_file(path)  # a stray from a killed stage
        elif rel not in (M.MANIFEST_NAME, M.JOURNAL_NAME, M.LOCK_NAME):
            on_disk[rel] = int(info.get("size") or 0)
    known = _load(dfs, droot)
    objects = src.list()
    to_fetch, skip, gone = diff(objects, known, on_disk)
    deleted = 0
    if delete:
        for rel in gone:
            dfs.rm_file(f"{droot}/{rel}")
            deleted += 1
    entries = {o.rel: known[o.rel] for o in skip}
    jobs = plan_jobs(src.head_func(), droot, to_fetch, verify, workers)
    lock = threading.Lock()
    failures: dict[str, BaseException] = {}

    def copy_one(job) -> None:
        if cancel.is_set():
            raise StagingCancelled("stage cancelled")
        final = f"{droot}/{job.obj.rel}"
        tmp = f"{posixpath.dirname(final)}/{M.TMP_PREFIX}{uuid.uuid4().hex[:16]}"
        hashers = [V.SegmentHasher(s, e, job.plan.algo) for s, e in job.plan.segments]
        try:
            with dfs.open(tmp, "wb") as out:
                for index, (seg_start, seg_end) in enumerate(job.plan.segments):
                    pos = seg_start
                    while pos < seg_end:
                        stop = min(seg_end, pos + part_size)
                        data = b"".join(bytes(block) for block in fetch(job.obj, pos, stop))  # blocks may share a buffer
                        if len(data) != stop - pos:
                            raise VerifyError(f"{job.obj.rel}: short download at {pos}")
                        out.write(data)
                        hashers[index].add(pos, stop, data, None)
                        pos = stop
            checksum = V.finish(job.plan, hashers, job.obj.rel)
            dfs.mv(tmp, final)
        except BaseException:
            if dfs.exists(tmp):
                dfs.rm_file(tmp)
            raise
        with lock:
            entries[job.obj.rel] = M.Entry(size=job.obj.size, token=job.obj.token, etag=job.obj.etag,
                                           version_id=job.obj.version_id, checksum=checksum)

    def guarded(job) -> None:
        try:
            copy_one(job)
        except BaseException as e:  # noqa: BLE001 - collected and reported together
            failures[job.obj.rel] = e

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(guarded, jobs))
    if failures:
        from operators.staging.engine import _raise_failures
        _raise_failures(failures, cancel)
    manifest_path = f"{droot}/{M.MANIFEST_NAME}"
    doc = {"format": M.FORMAT, "source": redact_url(source), "complete": True,
           "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "file_count": len(entries),
           "total_bytes": sum(e.size for e in entries.values()),
           "files": {rel: asdict(entries[rel]) for rel in sorted(entries)}}
    tmp = f"{droot}/{M.TMP_PREFIX}manifest"
    dfs.pipe_file(tmp, json.dumps(doc, indent=1).encode())
    dfs.mv(tmp, manifest_path)
    seconds = time.monotonic() - started
    fetched_bytes = sum(o.size for o in to_fetch)
    result = StageResult(source=redact_url(source), destination=destination, manifest_path=manifest_path,
                         files_total=len(objects), bytes_total=sum(o.size for o in objects), fetched=len(to_fetch),
                         skipped=len(skip), deleted=deleted, gone=gone, bytes_fetched=fetched_bytes,
                         seconds=round(seconds, 3),
                         mb_per_s=round(fetched_bytes / 1e6 / seconds, 6) if fetched_bytes else 0.0)
    log.info("%s", result.summary())
    return result


def _load(dfs: Any, droot: str) -> dict[str, M.Entry]:
    try:
        doc = json.loads(dfs.cat_file(f"{droot}/{M.MANIFEST_NAME}"))
    except (FileNotFoundError, ValueError):
        return {}
    if doc.get("format") != M.FORMAT:
        return {}
    try:
        return {rel: M.Entry(**item) for rel, item in doc.get("files", {}).items()}
    except TypeError as e:
        raise StagingError(f"unreadable manifest in {droot!r}: {e}") from e
