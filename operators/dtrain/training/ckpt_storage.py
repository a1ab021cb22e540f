"""Where DCP checkpoints live: the shared filesystem (a local path) or object storage (s3://, fsspec).

The checkpoint code (:mod:`dtrain.training.dcp`) needs few operations, the same on both: list the
checkpoint folders, write and read a small file (the commit marker), remove a checkpoint, and a DCP
storage writer/reader for one checkpoint. Local writes are temp file + fsync + rename (+ the
folder's fsync); an S3 object appears whole when its PUT completes, so a marker is atomic on both.

Credentials for s3:// come from the rank's environment (``AWS_*`` variables, an instance role: what
s3fs and botocore read) or from ``storage_options`` (s3fs's own: ``key``, ``secret``,
``endpoint_url``...). Names read back from storage are untrusted: only ``step-NNNNNNNN`` folders
are looked at, and a marker is read bounded.

Imports of torch and s3fs are lazy (this module is imported by the training helper's package).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from dtrain.atomic import atomic_write_bytes, fsync_directory
from dtrain.grammar import CHECKPOINT_URL, checkpoint_location

#: a commit marker is a small JSON object; more than this is not one
MAX_MARKER_BYTES = 64 * 1024


class LocalStorage:
    """Checkpoints under a local directory (the shared filesystem every node mounts)."""

    def __init__(self, root: str):
        self.root = root

    def __repr__(self) -> str:
        return self.root

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def make_root(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def names(self) -> list[str]:
        """Folder names directly under the root (none when it does not exist)."""
        try:
            return [e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return []

    def read_small(self, *parts: str) -> bytes | None:
        try:
            fd = os.open(self.path(*parts), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError, OSError):
            return None
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(MAX_MARKER_BYTES + 1)
        return data if len(data) <= MAX_MARKER_BYTES else None

    def write_small(self, *parts: str, data: bytes) -> None:
        """Write whole or not at all: an exclusive temp file, fsynced, renamed, then the folder fsynced."""
        atomic_write_bytes(self.path(*parts), data)

    def remove_file(self, *parts: str) -> None:
        try:
            os.unlink(self.path(*parts))
        except FileNotFoundError:
            pass
        fsync_directory(os.path.dirname(self.path(*parts)))

    def remove_tree(self, name: str) -> None:
        shutil.rmtree(self.path(name), ignore_errors=True)

    def writer(self, name: str, host_buffers=None):
        """DCP's writer for checkpoint ``name``; an asynchronous save stages through ``host_buffers``."""
        from dtrain.training.dcp_io import DiskWriter

        return DiskWriter(self.path(name), host_buffers)  # each shard file fsynced before it counts

    def reader(self, name: str):
        from dtrain.training.dcp_io import DiskReader

        return DiskReader(self.path(name))


class FsspecStorage:
    """Checkpoints under an object-storage prefix (s3://bucket/prefix), through fsspec/s3fs."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.root = url
        self.options = dict(storage_options or {})
        self._fs = None

    def __repr__(self) -> str:
        return self.root

    @property
    def fs(self):
        if self._fs is None:
            from fsspec.core import url_to_fs

            self._fs, _ = url_to_fs(self.root, **self.options)
        return self._fs

    def path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def make_root(self) -> None:
        pass  # a prefix exists once an object is under it

    def names(self) -> list[str]:
        self.fs.invalidate_cache(self.root)  # other ranks and other runs write here: never trust a listing cache
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"]

    def read_small(self, *parts: str) -> bytes | None:
        try:
            with self.fs.open(self.path(*parts), "rb") as fh:
                data = fh.read(MAX_MARKER_BYTES + 1)
        except FileNotFoundError:
            return None
        return data if len(data) <= MAX_MARKER_BYTES else None

    def write_small(self, *parts: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(*parts), data)  # one PUT: the object appears whole or not at all

    def remove_file(self, *parts: str) -> None:
        try:
            self.fs.rm_file(self.path(*parts))
        except FileNotFoundError:
            pass

    def remove_tree(self, name: str) -> None:
        try:
            self.fs.rm(self.path(name), recursive=True)
        except FileNotFoundError:
            pass

    def size(self, name: str) -> int:
        return sum(int(e.get("size") or 0) for e in self.fs.ls(self.path(name), detail=True)
                   if e.get("type") == "file")

    def writer(self, name: str, host_buffers=None):
        from dtrain.training.dcp_io import ObjectStoreWriter

        return ObjectStoreWriter(self.path(name), host_buffers, **self.options)

    def reader(self, name: str):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self.path(name), **self.options)


def open_storage(location: str, storage_options: dict[str, Any] | None = None) -> LocalStorage | FsspecStorage:
    """The storage for ``location`` (checked against :func:`dtrain.grammar.checkpoint_location`)."""
    location = checkpoint_location("directory", location)
    if CHECKPOINT_URL.fullmatch(location):
        return FsspecStorage(location, storage_options)
    return LocalStorage(location)
