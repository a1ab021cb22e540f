"""The preprocessing engine (no Airflow): one partition over all cores, then a finalize that publishes.

    summary = process_partition("s3://raw/day=2024-01-01/part-0.jsonl", "/fsx/ds/2024-01-01",
                                "mypkg.prep:transform")
    manifest = finalize_dataset("/fsx/ds/2024-01-01", [summary])

A partition is done when ``parts/<name>/_partition.json`` exists; a rerun with the same
input and transform returns it without work (idempotent). A killed run keeps every shard
whose index was written; the rerun recomputes only the rest (resumable). The manifest is
written by finalize only, last and atomically, and only when the bad-record check passes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import time
from collections import deque
from typing import Any, Callable, Iterator

from dtrain.errors import SpecError
from dtrain.preprocess import shardfmt
from dtrain.preprocess.errors import PreprocessError, TooManyBadRecords
from dtrain.preprocess.inputs import (DEFAULT_MAX_RECORD_BYTES, MAX_RECORD_BYTES_CAP, InputFile, expand_input,
                                      iter_chunks)
from dtrain.preprocess.packing import Packing, packing_option
from dtrain.preprocess.store import Store
from dtrain.preprocess.transform import identity, resolve, variable_fields
from dtrain.preprocess.worker import process_chunk

DEFAULT_SHARD_SIZE = 8192
DEFAULT_MAX_BAD_FRACTION = 0.001
PARTITION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,127}$")
Log = Callable[[str], None]
MAX_RECORD_BYTES_ALLOWED = (f"a whole number of bytes from 1 to {MAX_RECORD_BYTES_CAP}: the largest input record "
                            f"(line, .npy row) read; a longer one is quarantined unread "
                            f"(default {DEFAULT_MAX_RECORD_BYTES} = 64 MiB)")


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def partition_name(url: str) -> str:
    """Readable and unique per URL: the file or folder name, plus a short hash of the whole URL."""
    base = url.rstrip("/").rsplit("/", 1)[-1].split(".", 1)[0]
    base = re.sub(r"[^A-Za-z0-9._=-]+", "_", base).strip("._-")[:64] or "input"
    return f"{base}-{hashlib.sha1(url.encode()).hexdigest()[:8]}"


def coerce_max_record_bytes(value: Any) -> int:
    """The limit from text (the CLI, a rendered template) or a number; refused with the engine's message."""
    from dtrain.args import coerce_int

    try:
        return coerce_int("max_record_bytes", value, minimum=1, maximum=MAX_RECORD_BYTES_CAP)
    except SpecError as e:
        raise SpecError("max_record_bytes", value, MAX_RECORD_BYTES_ALLOWED) from e


def validate(*, transform: str, workers: int | None, shard_size: int, max_bad_fraction: float,
             partition: str | None, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
             pack: Any = None) -> tuple[dict[str, Any], Packing | None]:
    """Check every argument before any work; returns the transform identity and the packing option."""
    pack = packing_option(pack)
    if not isinstance(max_record_bytes, int) or isinstance(max_record_bytes, bool) \
            or not 1 <= max_record_bytes <= MAX_RECORD_BYTES_CAP:
        raise SpecError("max_record_bytes", max_record_bytes, MAX_RECORD_BYTES_ALLOWED)
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise SpecError("workers", workers, "a positive integer (default: every core of the machine it runs on)")
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
        raise SpecError("shard_size", shard_size, "a positive integer number of input records per shard")
    if not isinstance(max_bad_fraction, (int, float)) or isinstance(max_bad_fraction, bool) \
            or not 0.0 <= max_bad_fraction <= 1.0:
        raise SpecError("max_bad_fraction", max_bad_fraction, "a fraction between 0 and 1 (default 0.001 = 0.1%)")
    if partition is not None and not PARTITION_NAME.match(partition):
        raise SpecError("partition", partition, "1-128 characters of [A-Za-z0-9._=-], not starting with a symbol")
    ident = identity(transform)
    variable_fields(resolve(transform))  # a bad declaration fails here, not in every worker
    return ident, pack


# max_record_bytes and pack are in both fingerprints: they decide which records are quarantined and
# what a shard holds, so shards made under other settings are not reused.
def _chunk_fingerprint(ident: dict[str, Any], file: InputFile, chunk_index: int, shard_size: int,
                       max_record_bytes: int, pack: Packing | None) -> str:
    key = json.dumps([shardfmt.FORMAT_VERSION, ident, file.url, file.fingerprint, file.format,
                      chunk_index, shard_size, max_record_bytes, pack and pack.as_dict()], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


def _partition_fingerprint(ident: dict[str, Any], files: list[InputFile], shard_size: int,
                           max_record_bytes: int, pack: Packing | None) -> str:
    key = json.dumps([shardfmt.FORMAT_VERSION, ident, [(f.url, f.fingerprint) for f in files], shard_size,
                      max_record_bytes, pack and pack.as_dict()], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()


_active: set["_Pool"] = set()


def terminate_active() -> None:
    """Kill the worker processes of every partition running in this process (the operator's on_kill)."""
    for pool in list(_active):
        pool.kill()


class _Pool:
    """Ordered map over ``workers`` spawned processes, each given one chunk at a time on its own
    pipe; results come back in task order, with at most ``2 * workers`` waiting (memory stays flat
    on big inputs).

    Neither concurrent.futures nor multiprocessing.Pool: their queues hold POSIX named semaphores
    (``/dev/shm/sem.mp-*``) that only a clean exit or multiprocessing's resource tracker unlinks,
    and a node crash (SIGKILL of the whole process group, tracker included) left five behind per
    run. A pipe is a socketpair passed to the child as a descriptor: it has no name to leave. A
    worker that dies (OOM killer, a crash in native code) is seen on its pipe and fails the
    partition instead of hanging it.
    """

    def __init__(self, workers: int):
        self.workers = workers
        self._procs: list[tuple[Any, Any]] = []  # (process, the runner's end of its pipe)
        if workers > 1:
            import multiprocessing

            from dtrain.preprocess.worker import serve

            # spawn: no inherited threads or locks (Airflow's task runner has both); the
            # transform is importable by name, so the workers need nothing else from us.
            context = multiprocessing.get_context("spawn")
            _active.add(self)
            try:
                with _main_without_path(), _as_plain_process():
                    for _ in range(workers):
                        ours, theirs = context.Pipe()
                        proc = context.Process(target=serve, args=(theirs,), name="dtrain-preprocess-worker")
                        proc.start()
                        theirs.close()
                        self._procs.append((proc, ours))
            except BaseException:
                self.close(ok=False)  # the workers already started
                raise

    def map(self, tasks: Iterator[tuple[Any, dict | None]]) -> Iterator[tuple[Any, dict | None]]:
        """tasks yields (key, task or None for "already done"); results come back in task order."""
        if not self._procs:
            for key, task in tasks:
                yield key, None if task is None else process_chunk(task)
            return
        pending: deque[list] = deque()  # [key, result, done], in task order
        idle, busy = list(self._procs), {}
        tasks, exhausted = iter(tasks), False
        while True:
            while not exhausted and idle and len(pending) <= 2 * self.workers:
                item = next(tasks, None)
                if item is None:
                    exhausted = True
                    break
                entry = [item[0], None, item[1] is None]
                pending.append(entry)
                if item[1] is not None:
                    worker = idle.pop()
                    worker[1].send(item[1])
                    busy[worker] = entry
            while pending and pending[0][2]:
                key, value, _ = pending.popleft()
                yield key, value
            if exhausted and not pending:
                return
            if not exhausted and idle and len(pending) <= 2 * self.workers:
                continue
            for worker in self._answered(busy):
                entry = busy.pop(worker)
                entry[1], entry[2] = _reply(worker), True
                idle.append(worker)

    @staticmethod
    def _answered(busy: dict) -> list:
        """The busy workers that have answered (blocks until one has; a death wakes it too)."""
        from multiprocessing.connection import wait

        ready = set(wait([conn for _, conn in busy] + [proc.sentinel for proc, _ in busy]))
        return [worker for worker in busy if worker[1] in ready or worker[0].sentinel in ready]

    def kill(self) -> None:
        # Running chunks die mid-way: their shards are written atomically (index last), so a
        # half-done chunk leaves nothing a rerun would trust.
        for proc, _ in self._procs:
            proc.kill()

    def close(self, ok: bool) -> None:
        if not self._procs:
            return
        _active.discard(self)
        for proc, conn in self._procs:
            try:
                if ok:
                    conn.send(None)  # finish: the worker returns
            except OSError:
                pass
            if not ok:
                proc.kill()
        for proc, conn in self._procs:
            proc.join()
            conn.close()


def _reply(worker: tuple[Any, Any]) -> dict:
    """The shard index a worker sent; its exception raised here; RuntimeError when it died instead."""
    proc, conn = worker
    try:
        reply = conn.recv()
    except (EOFError, OSError):
        proc.join()
        raise RuntimeError(f"worker process {proc.pid} died (exit code {proc.exitcode}) while processing a chunk")
    if reply[0] == "error":
        reply[1].add_note(f"in worker process {proc.pid}:\n{reply[2]}")
        raise reply[1]
    return reply[1]


@contextlib.contextmanager
def _as_plain_process() -> Iterator[None]:
    """Under the CeleryExecutor a task runs in a process forked from the worker's pool process, and
    multiprocessing's "current process" is that pool process, billiard's (Celery's fork of
    multiprocessing installs it there): daemonic, which multiprocessing refuses children ("daemonic
    processes are not allowed to have children"), and holding billiard's authentication key, which spawn
    refuses to pickle. Every preprocess with workers failed there. The rule against a daemon's children
    keeps a daemonic parent from orphaning children it never joins: this pool joins or kills its own in
    :meth:`_Pool.close`, and they end by themselves when their pipe closes. So while the workers start,
    the current process's settings (the private ``_config`` new processes copy) are a plain process's:
    not daemonic, the same key as multiprocessing's own type. Put back after."""
    from multiprocessing import process

    current = process.current_process()
    saved = current._config
    key = bytes(saved.get("authkey") or os.urandom(32))
    current._config = dict(saved, daemon=False, authkey=process.AuthenticationString(key))
    try:
        yield
    finally:
        current._config = saved


@contextlib.contextmanager
def _main_without_path() -> Iterator[None]:
    """Spawned workers start by re-running the parent's ``__main__`` (file, or module by name). Under Airflow's
    LocalExecutor that file is the ``airflow`` CLI, whose import needs database settings a task
    process deliberately lacks, so every worker died before its first chunk. The workers need
    nothing from ``__main__`` (the transform is imported by name): hide its path while they start.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    path = main.__dict__.pop("__file__", None)
    spec = main.__dict__.get("__spec__")
    main.__spec__ = None  # `python -m pkg` would have them import pkg.__main__ by name instead
    try:
        yield
    finally:
        main.__spec__ = spec
        if path is not None:
            main.__file__ = path


def process_partition(inputs: str | list[str], output: str, transform: str, *, partition: str | None = None,
                      workers: int | None = None, shard_size: int = DEFAULT_SHARD_SIZE,
                      max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION, check_bad: bool = True,
                      log: Log = print, pool: "_Pool | None" = None,
                      max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, pack: Any = None) -> dict[str, Any]:
    """Preprocess one input partition (a URL or a list of URLs) into ``output/parts/<partition>/``.

    A record (line, .npy row) above ``max_record_bytes`` is quarantined without being read
    into memory (see :mod:`dtrain.preprocess.inputs` for what each format bounds).
    ``pack`` ({"field", "block_size", "separator"}, :mod:`dtrain.preprocess.packing`) packs each
    shard's token sequences into fixed-length blocks.
    Returns the partition summary (primitives only: what the operator pushes to XCom).
    Raises :class:`TooManyBadRecords` when this partition alone is above the threshold
    (``check_bad=False`` leaves that check to :func:`finalize_dataset`, which then writes
    the dataset's quarantine.jsonl before failing).
    """
    urls = [inputs] if isinstance(inputs, str) else list(inputs)
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise SpecError("input", inputs, "a URL or a non-empty list of URLs")
    partition = partition or partition_name(urls[0] if len(urls) == 1 else "|".join(urls))
    ident, pack = validate(transform=transform, workers=workers, shard_size=shard_size,
                           max_bad_fraction=max_bad_fraction, partition=partition, max_record_bytes=max_record_bytes,
                           pack=pack)
    files = [f for url in urls for f in expand_input(url)]
    workers = min(workers or default_workers(), 64)
    store = Store(output)
    pdir = shardfmt.part_dir(partition)
    fingerprint = _partition_fingerprint(ident, files, shard_size, max_record_bytes, pack)

    done = shardfmt.read_json(store, f"{pdir}/{shardfmt.PARTITION_DONE}")
    if done and done.get("fingerprint") == fingerprint and all(
            shardfmt.shard_intact(store, s, verify=False) for s in done["shards"]):
        log(f"[preprocess] partition {partition}: already complete ({done['samples']} samples), nothing to do")
        return _xcom(done, store)

    started = time.monotonic()
    store.remove_temp_files(pdir)  # left by a killed run: never trusted, now not kept either
    stats = {"kept": 0, "written": 0}
    unpublished = []

    def tasks() -> Iterator[tuple[str, dict | None]]:
        for file_index, file in enumerate(files):
            for chunk in iter_chunks(file, shard_size, max_record_bytes):
                name = f"shard-{file_index:04d}-{chunk.index:05d}"
                fp = _chunk_fingerprint(ident, file, chunk.index, shard_size, max_record_bytes, pack)
                old = shardfmt.read_shard_index(store, partition, name)
                if old and old.get("fingerprint") == fp and shardfmt.shard_intact(store, old, verify=True):
                    stats["kept"] += 1
                    yield name, None
                    continue
                if not unpublished:
                    # Shards are about to change: a manifest from an earlier run no longer describes them.
                    store.remove(shardfmt.MANIFEST)
                    unpublished.append(True)
                stats["written"] += 1
                yield name, {"transform": transform, "output": output, "partition": partition, "name": name,
                             "file": file.url, "format": file.format, "header": chunk.header,
                             "records": chunk.records, "first_line": chunk.first_line, "fingerprint": fp,
                             "pack": pack and pack.as_dict()}

    own_pool = pool is None
    pool = _Pool(workers) if own_pool else pool
    workers = pool.workers
    ok = False
    try:
        shards = []
        for name, index in pool.map(tasks()):
            shards.append(index if index is not None else shardfmt.read_shard_index(store, partition, name))
        ok = True
    except (PreprocessError, SpecError):
        raise
    except Exception as e:
        raise PreprocessError(f"partition {partition}: a worker failed: {type(e).__name__}: {e}") from e
    finally:
        if own_pool or not ok:
            pool.close(ok)

    quarantine = [q for s in shards for q in s.get("quarantine", [])]
    store.write_text(f"{pdir}/{shardfmt.QUARANTINE}", "".join(json.dumps(q, sort_keys=True) + "\n" for q in quarantine))
    summary = {
        "name": partition, "inputs": urls, "files": [f.url for f in files], "fingerprint": fingerprint,
        "transform": ident, "shard_size": shard_size, "max_record_bytes": max_record_bytes,
        "pack": pack and pack.as_dict(),
        "records": sum(s["records"] for s in shards), "samples": sum(s["num_samples"] for s in shards),
        "dropped": sum(s["dropped"] for s in shards), "bad": len(quarantine),
        "input_bytes": sum(f.size for f in files),
        "output_bytes": sum(i["bytes"] for s in shards for i in s["files"].values()),
        "shards": [{k: v for k, v in s.items() if k != "quarantine"} for s in shards],
    }
    elapsed = time.monotonic() - started
    log(f"[preprocess] partition {partition}: {summary['records']} records -> {summary['samples']} samples in "
        f"{len(shards)} shards ({stats['written']} written, {stats['kept']} kept from an earlier run), "
        f"{summary['dropped']} dropped, {summary['bad']} bad, {workers} worker(s), {elapsed:.1f}s")
    if check_bad:
        check_bad_fraction(summary["bad"], summary["records"], max_bad_fraction,
                           store.display(f"{pdir}/{shardfmt.QUARANTINE}"), f"partition {partition}")
    store.write_text(f"{pdir}/{shardfmt.PARTITION_DONE}", shardfmt.dumps(summary))
    return _xcom(summary, store)


def check_bad_fraction(bad: int, records: int, max_bad_fraction: float, quarantine: str, where: str) -> None:
    if bad and bad > max_bad_fraction * records:
        raise TooManyBadRecords(bad, records, max_bad_fraction, quarantine, where)


def _xcom(summary: dict[str, Any], store: Store) -> dict[str, Any]:
    """Small and primitive: the shard list stays on disk, XCom gets counts and where to look."""
    keys = ("name", "inputs", "records", "samples", "dropped", "bad", "input_bytes", "output_bytes")
    return {**{k: summary[k] for k in keys}, "shards": len(summary["shards"]), "output": store.url,
            "path": store.display(shardfmt.part_dir(summary["name"]))}


def finalize_dataset(output: str, partitions: list[Any] | None = None, *,
                     max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION, log: Log = print) -> dict[str, Any]:
    """Check the finished partitions together and publish ``manifest.json`` (last, atomically).

    ``partitions``: names or summaries (what the mapped tasks returned); None means every
    finished partition under ``output/parts``. Raises :class:`TooManyBadRecords` (and
    publishes nothing) when the whole dataset is above ``max_bad_fraction``.
    """
    if not isinstance(max_bad_fraction, (int, float)) or isinstance(max_bad_fraction, bool) \
            or not 0.0 <= max_bad_fraction <= 1.0:
        raise SpecError("max_bad_fraction", max_bad_fraction, "a fraction between 0 and 1")
    store = Store(output)
    if partitions is None:
        names = [n for n in store.listdir(shardfmt.PARTS)
                 if shardfmt.read_json(store, f"{shardfmt.part_dir(n)}/{shardfmt.PARTITION_DONE}")]
    else:
        names = [p["name"] if isinstance(p, dict) else str(p) for p in partitions]
    if not names:
        raise PreprocessError(f"{store.url}: no finished partition to publish")
    if len(set(names)) != len(names):
        raise PreprocessError(f"partition names are not unique: {sorted(names)}")
    summaries = []
    for name in names:
        summary = shardfmt.read_json(store, f"{shardfmt.part_dir(name)}/{shardfmt.PARTITION_DONE}")
        if summary is None:
            raise PreprocessError(f"partition {name} is not finished under {store.url} (no {shardfmt.PARTITION_DONE})")
        summaries.append(summary)

    for key, what in (("transform", "transforms"), ("pack", "pack settings")):
        made_by = {json.dumps(s.get(key), sort_keys=True) for s in summaries}
        if len(made_by) != 1:
            raise PreprocessError(f"partitions were made by different {what}: {sorted(made_by)}")
    shards = [s for summary in summaries for s in summary["shards"] if s["num_samples"]]
    fields = _common_fields(shards)
    quarantine = b"".join(store.read_bytes(f"{shardfmt.part_dir(n)}/{shardfmt.QUARANTINE}") or b"" for n in names)
    store.write_bytes(shardfmt.QUARANTINE, quarantine)
    records = sum(s["records"] for s in summaries)
    bad = sum(s["bad"] for s in summaries)
    check_bad_fraction(bad, records, max_bad_fraction, store.display(shardfmt.QUARANTINE), "dataset")
    manifest = {
        "format": shardfmt.FORMAT, "format_version": shardfmt.manifest_version(fields),
        "num_samples": sum(s["num_samples"] for s in shards), "fields": fields,
        "shards": [{"path": f"{shardfmt.part_dir(s['partition'])}/{s['name']}", "partition": s["partition"],
                    "num_samples": s["num_samples"], "sha256": s["sha256"], "files": s["files"],
                    "source": {"file": s["file"], "first_line": s["first_line"], "records": s["records"]}}
                   for s in shards],
        "source": {"partitions": [{k: s[k] for k in ("name", "inputs", "files", "records", "samples", "dropped",
                                                     "bad", "fingerprint")} for s in summaries]},
        "transform": summaries[0]["transform"],
        "records": records, "dropped": sum(s["dropped"] for s in summaries), "bad_records": bad,
        "max_bad_fraction": max_bad_fraction, "quarantine": shardfmt.QUARANTINE,
    }
    if summaries[0].get("pack"):
        manifest["packing"] = {**summaries[0]["pack"], **{
            key: sum(s["packing"][key] for summary in summaries for s in summary["shards"])
            for key in ("sequences", "tokens", "dropped_tokens")}}
    if manifest["num_samples"] == 0:
        raise PreprocessError(f"{store.url}: the transform kept no sample out of {records} records")
    store.write_text(shardfmt.MANIFEST, shardfmt.dumps(manifest))
    log(f"[preprocess] published {store.display(shardfmt.MANIFEST)}: {manifest['num_samples']} samples in "
        f"{len(shards)} shards from {len(summaries)} partition(s); {bad} bad record(s) quarantined")
    return {"manifest": store.display(shardfmt.MANIFEST), "num_samples": manifest["num_samples"],
            "shards": len(shards), "partitions": names, "records": records, "bad_records": bad,
            "dropped": manifest["dropped"], "fields": fields}


def _common_fields(shards: list[dict[str, Any]]) -> dict[str, Any]:
    fields = None
    for s in shards:
        merged = s["fields"] if fields is None else shardfmt.merge_fields(fields, s["fields"])
        if merged is None:
            raise PreprocessError(f"shard {s['partition']}/{s['name']} has fields {s['fields']}, "
                                  f"other shards have {fields}: the transform must return the same "
                                  f"field names, dtypes and shapes (or variable lengths) for every record")
        fields = merged
    return fields or {}


def preprocess(inputs: list[str], output: str, transform: str, *, workers: int | None = None,
               shard_size: int = DEFAULT_SHARD_SIZE, max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
               log: Log = print, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, pack: Any = None) -> dict[str, Any]:
    """Every input URL as its own partition, then finalize: what ``dtrain preprocess`` runs."""
    validate(transform=transform, workers=workers, shard_size=shard_size,
             max_bad_fraction=max_bad_fraction, partition=None, max_record_bytes=max_record_bytes, pack=pack)
    for url in inputs:
        expand_input(url)  # every input is checked before the first one is processed
    pool = _Pool(min(workers or default_workers(), 64))  # one pool for every partition: spawn once
    ok = False
    try:
        summaries = [process_partition(url, output, transform, workers=workers, shard_size=shard_size,
                                       max_bad_fraction=max_bad_fraction, check_bad=False, log=log, pool=pool,
                                       max_record_bytes=max_record_bytes, pack=pack)
                     for url in inputs]
        ok = True
    finally:
        pool.close(ok)
    return finalize_dataset(output, summaries, max_bad_fraction=max_bad_fraction, log=log)
