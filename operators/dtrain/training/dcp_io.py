"""DCP's file writer and reader, tuned for the disk: several files per rank written and read by as many
threads, and no CRC32 over every byte.

Where a synchronous DCP save's time goes with torch's defaults (one writer thread, one file per rank):
every tensor is copied to pageable host memory one at a time, ``torch.save`` computes a CRC32 over its
bytes, and only then is it written, all in one thread; the disk sits idle during the copies and the
checksum. Here the tensors arrive already in host memory (:mod:`dtrain.training.host_buffers`), the
checksum is off while the checkpoint's files are written (``torch.load``, which is how DCP reads a shard
back, never verifies it, so it is pure cost), and :data:`THREADS` threads write their own files in
parallel (a large ``write`` and ``fsync`` run without the GIL). A load reads the files of a rank in
parallel the same way.

The on-disk format is DCP's own: any ``torch.distributed.checkpoint.load`` reads these checkpoints.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.futures import Future

#: files (and writer threads) per rank and checkpoint
THREADS = 4

_crc_lock = threading.Lock()
_crc_users = 0
_crc_before = True


@contextmanager
def crc32_off() -> Iterator[None]:
    """torch.save without its per-record CRC32 while any checkpoint write of this process runs (the
    option is process-wide: a ``torch.save`` elsewhere in those seconds writes no checksum either, which
    ``torch.load`` accepts). A torch without the option computes it as before."""
    global _crc_users, _crc_before
    getter = getattr(torch.serialization, "get_crc32_options", None)
    setter = getattr(torch.serialization, "set_crc32_options", None)
    if getter is None or setter is None:
        yield
        return
    with _crc_lock:
        if _crc_users == 0:
            _crc_before = getter()
            setter(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                setter(_crc_before)


class HostStaged:
    """What both writers add to torch's: they are their own ``AsyncStager``, so ``dcp.async_save``
    stages through the checkpointer's kept host buffers (a writer that is an ``AsyncStager`` is the
    stager on every torch; ``async_save``'s own ``async_stager`` argument came later), and their files
    are written without checksums."""

    should_synchronize_after_execute = False  # stage() returns when the copy has landed

    def __init__(self, *args, host_buffers=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.host_buffers = host_buffers

    def stage(self, state_dict):
        if self.host_buffers is None:
            raise RuntimeError("an asynchronous save needs the checkpointer's host buffers")
        return self.host_buffers.stage(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def write_data(self, plan, planner) -> Future:
        with crc32_off():
            return super().write_data(plan, planner)


class DiskWriter(HostStaged, FileSystemWriter):
    """FileSystemWriter with :data:`THREADS` files per rank, each fsynced."""

    def __init__(self, path: str, host_buffers=None):
        super().__init__(path, host_buffers=host_buffers, single_file_per_rank=True, sync_files=True,
                         thread_count=THREADS)


class ObjectStoreWriter(HostStaged, FsspecWriter):
    """FsspecWriter (s3://): an object appears whole when its upload completes, so no sync."""

    def __init__(self, path: str, host_buffers=None, **options):
        super().__init__(path, host_buffers=host_buffers, sync_files=False, **options)


class DiskReader(FileSystemReader):
    """FileSystemReader that reads a rank's files in parallel, one thread each."""

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if len(per_file) <= 1:
            return super().read_data(plan, planner)
        with ThreadPoolExecutor(len(per_file), thread_name_prefix="dtrain-dcp-read") as pool:
            parts = [pool.submit(FileSystemReader.read_data, self, dataclasses.replace(plan, items=items), planner)
                     for items in per_file.values()]
            for part in parts:
                part.result().wait()  # the thread's error, then the read's (DCP's futures are torch's)
        done: Future = Future()
        done.set_result(None)
        return done
