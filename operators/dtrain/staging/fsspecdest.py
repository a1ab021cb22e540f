"""A destination given as an fsspec URL that is no POSIX path (memory://, s3://, gcs://...).

``local://`` and ``file://`` URLs are POSIX directories and go to
:class:`dtrain.staging.posixdest.PosixDestination` (:func:`dtrain.staging.engine.open_destination`):
the same flock across processes, the same refusal of symlinks, the journal.

The shared filesystem is normally a POSIX mount (:mod:`dtrain.staging.posixdest`). Here
object stores take no writes at an offset, so each file is streamed in order (one range
per file; files still copy in parallel) into a hidden temporary name, verified, closed
(the store's own durability: an S3 upload is complete when it returns) and moved to its
final name, as atomically as the store allows. There is no journal (object stores cannot
append): a killed stage refetches what it had not recorded. The manifest is written last.
"""

from __future__ import annotations

import posixpath
import threading
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

from dtrain.staging import manifest as M
from dtrain.staging.destination import Destination, TempFile
from dtrain.staging.errors import DestinationError, StagingError
from dtrain.staging.sources import redact_url

# Object stores have no flock: the lock keeps two stages of this process out of one
# destination; stages in different processes must use different destinations.
_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


class FsspecDestination(Destination):
    ranged_writes = False
    batched = False

    def __init__(self, url: str):
        import fsspec.core

        self.name = redact_url(url)
        try:
            # A fresh instance: a cached one keeps its first endpoint/credentials and listings.
            self._fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
        except (ImportError, ValueError, TypeError) as e:
            raise StagingError(f"no filesystem for destination {self.name!r}: {e}") from e
        self._root = root.rstrip("/")
        self.manifest_path = f"{self._root}/{M.MANIFEST_NAME}"

    def prepare(self) -> None:
        try:
            self._fs.makedirs(self._root, exist_ok=True)
        except OSError as e:  # the user's input (a bucket or path that cannot be written): exit status 2
            raise DestinationError(f"destination {self.name!r} cannot be written: {e}") from e

    @contextmanager
    def lock(self) -> Iterator[None]:
        key = self._fs.unstrip_protocol(self._root)
        with _LOCKS_GUARD:
            held = _LOCKS.setdefault(key, threading.Lock())
        if not held.acquire(blocking=False):
            raise StagingError(f"another stage is writing to {self.name!r} right now")
        try:
            yield
        finally:
            held.release()

    def scan(self) -> dict[str, int]:
        try:
            listing = self._fs.find(self._root, detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        found: dict[str, int] = {}
        for path, info in listing.items():
            if not path.startswith(self._root + "/"):
                continue
            rel = path[len(self._root) + 1:]
            if posixpath.basename(rel).startswith(M.TMP_PREFIX):
                _remove(self._fs, path)  # a stray from a killed stage
            elif rel not in M.RESERVED_NAMES:
                found[rel] = int(info.get("size") or 0)
        return found

    def load(self) -> dict[str, M.Entry]:
        try:
            return M.parse(self._fs.cat_file(self.manifest_path))
        except FileNotFoundError:
            return {}

    def remove(self, rels: list[str]) -> int:
        removed = 0
        for rel in rels:
            try:
                self._fs.rm_file(f"{self._root}/{rel}")
                removed += 1
            except FileNotFoundError:
                continue
        return removed

    def make_dirs(self, rels: Iterable[str]) -> None:
        for rel_dir in sorted({posixpath.dirname(rel) for rel in rels}):
            path = f"{self._root}/{rel_dir}" if rel_dir else self._root
            try:
                self._fs.makedirs(path, exist_ok=True)
            except (FileExistsError, NotADirectoryError) as e:
                raise StagingError(f"destination {path!r} is a file where the source has a directory; "
                                   f"remove it or stage with delete=True") from e

    def create(self, rel: str, size: int, parts: int) -> "FsspecTempFile":
        return FsspecTempFile(self._fs, f"{self._root}/{rel}")

    def needs_manifest(self) -> bool:
        return not self._fs.exists(self.manifest_path)

    def write_manifest(self, source: str, entries: dict[str, M.Entry]) -> None:
        tmp = f"{self._root}/{M.temp_name()}"
        self._fs.pipe_file(tmp, M.render(source, entries))
        self._fs.mv(tmp, self.manifest_path)


class FsspecTempFile(TempFile):
    """A file streamed in order into the store under a hidden name."""

    def __init__(self, fs: Any, final: str):
        self._fs = fs
        self.final = final
        self.path = f"{posixpath.dirname(final)}/{M.temp_name()}"
        self._out = fs.open(self.path, "wb")
        self._written = 0

    def write(self, pos: int, block: Any) -> None:
        if pos != self._written:  # the copier gives a non-ranged destination one range per file
            raise StagingError(f"internal: write at {pos} of {self.final!r}, expected {self._written}")
        self._out.write(bytes(block))  # a copy: the block's buffer is reused for the next one
        self._written += len(block)

    def size(self) -> int:
        return self._written

    def close(self) -> None:
        self._out.close()

    def land(self) -> None:
        self._fs.mv(self.path, self.final)

    def discard(self) -> None:
        try:
            self._out.close()
        except Exception:  # noqa: BLE001 - a half-written upload; the file is removed next
            pass
        _remove(self._fs, self.path)


def _remove(fs: Any, path: str) -> None:
    """Best effort: what cannot be removed now is a stray the next stage's scan removes."""
    try:
        if fs.exists(path):
            fs.rm_file(path)
    except Exception:  # noqa: BLE001
        pass
