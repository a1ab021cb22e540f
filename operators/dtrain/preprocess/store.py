"""A dataset directory on local disk or under any fsspec URL, with whole-file atomic writes.

Local: temp file in the same directory, fsync, rename (a kill leaves the old file or the new
one). Object stores (s3, gs, az, memory): one PUT is already atomic, so bytes go straight to
the key. Other fsspec filesystems: temp key, then move.
"""

from __future__ import annotations

import os
import posixpath

from dtrain.atomic import atomic_open

ATOMIC_PUT_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "memory"}


class Store:
    def __init__(self, root: str):
        import fsspec

        self.url = root
        self.fs, path = fsspec.core.url_to_fs(root)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.local = "file" in protocols or "local" in protocols
        self.atomic_put = bool(set(protocols) & ATOMIC_PUT_PROTOCOLS)
        self.root = os.path.abspath(path) if self.local else path.rstrip("/")

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if self.local else posixpath.join(self.root, rel)

    def display(self, rel: str) -> str:
        """A path a person can paste (a URL for remote stores)."""
        return self.path(rel) if self.local else self.fs.unstrip_protocol(self.path(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.write_parts(rel, [data])

    def write_parts(self, rel: str, parts: list) -> None:
        """Write the concatenation of ``parts`` (bytes-like objects) as one file, atomically."""
        target = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            # One fsync per file and none per folder, for thousands of shards; 0o666: the umask decides.
            with atomic_open(target, mode=0o666, fsync_dir=False) as fh:
                for part in parts:  # straight from each buffer: no joined copy of a large shard
                    fh.write(part)
            return
        data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        if self.atomic_put:
            self.fs.pipe_file(target, data)
        else:
            tmp = posixpath.join(posixpath.dirname(target), f".{posixpath.basename(target)}.{os.getpid()}.tmp")
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, target)

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode("utf-8"))

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            if self.local:
                with open(self.path(rel), "rb") as fh:
                    return fh.read()
            return self.fs.cat_file(self.path(rel))
        except FileNotFoundError:
            return None

    def size(self, rel: str) -> int | None:
        try:
            if self.local:
                return os.path.getsize(self.path(rel))
            return int(self.fs.info(self.path(rel))["size"])
        except FileNotFoundError:
            return None

    def remove(self, rel: str) -> None:
        try:
            if self.local:
                os.unlink(self.path(rel))
            else:
                self.fs.rm_file(self.path(rel))
        except FileNotFoundError:
            pass

    def remove_temp_files(self, rel: str) -> int:
        """Delete temp files a killed writer left under ``rel`` (local stores; object PUTs leave none)."""
        removed = 0
        if self.local:
            for name in self.listdir(rel):
                if name.startswith(".") and name.endswith(".tmp"):
                    self.remove(f"{rel}/{name}")
                    removed += 1
        return removed

    def listdir(self, rel: str) -> list[str]:
        """Names directly under ``rel`` (empty when it does not exist)."""
        try:
            if self.local:
                return sorted(os.listdir(self.path(rel)))
            return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.path(rel), detail=False))
        except FileNotFoundError:
            return []
