"""Where a stage writes: what the one staging loop does differently per kind of store.

The loop (:mod:`dtrain.staging.engine` and :mod:`dtrain.staging.copy`) lists, diffs,
copies with retries, reports progress, honours cancellation, verifies and writes the
manifest last, whatever the destination. A :class:`Destination` supplies the rest: the
lock, the scan of what is already there, how a file is written under a hidden temporary
name and moved into place, how it is made durable, and where the manifest goes.

Two implementations: :class:`dtrain.staging.posixdest.PosixDestination` (a directory on
a POSIX filesystem: pwrite, syncfs/fsync, flock, journal) and
:class:`dtrain.staging.fsspecdest.FsspecDestination` (any fsspec URL: memory://, s3://,
...; files streamed in order, the store's own durability).
"""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager
from typing import Any, Iterable

from dtrain.staging.manifest import Entry, Journal


class TempFile(abc.ABC):
    """One file being staged under a hidden temporary name in its final directory.

    ``write`` may be called from several threads at once (for different ranges) when the
    destination has ``ranged_writes``; otherwise ranges come one after the other, in order.
    """

    path: str   # the temporary name
    final: str  # where it lands

    @abc.abstractmethod
    def write(self, pos: int, block: Any) -> None:
        """Write ``block`` (bytes-like) at offset ``pos``."""

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end) already written: hashing reads back parts that landed out of order."""
        raise NotImplementedError("this destination writes in order; nothing is read back")

    @abc.abstractmethod
    def size(self) -> int:
        """The size of what was written so far."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish writing (flush; per-file durability where the destination uses it)."""

    @abc.abstractmethod
    def land(self) -> None:
        """Move the closed, verified file to its final name (as atomically as the store allows)."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Close if open and remove the temporary file; never raises (a stray is removed by the
        next stage's scan)."""


class Destination(abc.ABC):
    """A directory-like place a stage mirrors a source into."""

    name: str                   # how results and logs name it (no credentials)
    manifest_path: str          # where the manifest lands
    ranged_writes = True        # parts of one file may be written in parallel, in any order
    batched = False             # verified files wait for one ``sync`` per batch before they land

    @abc.abstractmethod
    def prepare(self) -> None:
        """Create the destination root; StagingError if it cannot be."""

    @abc.abstractmethod
    def lock(self) -> AbstractContextManager[Any]:
        """Held for the whole stage: two stages never write one destination at once."""

    @abc.abstractmethod
    def scan(self) -> dict[str, int]:
        """Relative path -> size of every staged file there; stray temp files are removed (the
        lock is held, so none can belong to a running stage)."""

    @abc.abstractmethod
    def load(self) -> dict[str, Entry]:
        """Entries of the last complete manifest, plus any journal a killed stage left."""

    @abc.abstractmethod
    def remove(self, rels: list[str]) -> int:
        """Delete these staged files (gone from the source); returns how many were deleted."""

    @abc.abstractmethod
    def make_dirs(self, rels: Iterable[str]) -> None:
        """Create the directories these files need, refusing any that resolves outside the root."""

    @abc.abstractmethod
    def create(self, rel: str, size: int, parts: int) -> TempFile:
        """A new temporary file for ``rel`` (``size`` bytes, to be written in ``parts`` ranges)."""

    def open_journal(self) -> Journal | None:
        """Where landed files are recorded as they land (resume after kill -9), or None."""
        return None

    def sync(self, files: list[TempFile]) -> None:
        """Make a batch of closed temp files durable before they land (only when ``batched``)."""

    def settle(self, rels: Iterable[str]) -> None:
        """Make the landed names themselves durable, before the manifest claims them."""

    @abc.abstractmethod
    def needs_manifest(self) -> bool:
        """True when the manifest must be (re)written even if nothing changed (missing, or a
        journal of a killed stage is left to fold in)."""

    @abc.abstractmethod
    def write_manifest(self, source: str, entries: dict[str, Entry]) -> None:
        """Write the complete manifest atomically, last; any journal is folded in and removed."""
