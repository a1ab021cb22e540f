"""A destination directory on a POSIX filesystem (the shared filesystem: FSx for Lustre, NFS, local).

Each file is written with ``os.pwrite`` into a hidden temporary file created in its final
directory (preallocated when it is written in parallel parts), verified, made durable
(one ``syncfs`` per batch of files, else ``fsync`` per file) and only then renamed. A
reader therefore never sees a partial file at a final path, even if the process is killed
with SIGKILL; the next stage removes the stray temporary files. Landed files are journaled
so a rerun resumes; an ``flock`` keeps two stages out of one directory.

Anyone who can write into the destination could plant symlinks there. Staging's own files are
opened with O_NOFOLLOW (:func:`dtrain.staging.manifest.open_own`) and new ones with O_EXCL under
unpredictable names; the directories a key needs are checked (no symlink, no file on the way)
for every key before any is made, then made one component at a time without following links.
"""

from __future__ import annotations

import fcntl
import os
import stat
from typing import Any, Iterable

from dtrain.staging import manifest as M
from dtrain.staging.destination import Destination, TempFile
from dtrain.staging.errors import DestinationError, StagingError, VerifyError


class PosixDestination(Destination):
    ranged_writes = True

    def __init__(self, path: str, fsync: bool = True):
        self.name = self.root = os.path.abspath(path)
        self.manifest_path = os.path.join(self.root, M.MANIFEST_NAME)
        # Durability before rename: one syncfs(2) for a batch of verified files (then their
        # renames: one journal commit instead of one per file); fsync per file where syncfs is
        # missing; none with fsync=False (survives kill -9, not a power cut).
        self._syncfs = _syncfs() if fsync else None
        self.batched = self._syncfs is not None
        self._fsync_each = fsync and not self.batched

    def prepare(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise unwritable(self.root, e) from e

    def lock(self) -> "DestinationLock":
        return DestinationLock(self.root)

    def scan(self) -> dict[str, int]:
        found: dict[str, int] = {}
        stack = [("", self.root)]
        while stack:
            rel_dir, path = stack.pop()
            try:
                entries = list(os.scandir(path))
            except FileNotFoundError:
                continue
            for entry in entries:
                rel = f"{rel_dir}{entry.name}"
                if entry.name.startswith(M.TMP_PREFIX):
                    _unlink(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    stack.append((rel + "/", entry.path))
                elif not (rel_dir == "" and entry.name in M.RESERVED_NAMES) and entry.is_file(follow_symlinks=False):
                    found[rel] = entry.stat(follow_symlinks=False).st_size
        return found

    def load(self) -> dict[str, M.Entry]:
        return M.load(self.root)

    def remove(self, rels: list[str]) -> int:
        removed = 0
        for rel in rels:
            path = os.path.join(self.root, rel)
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                continue
            parent = os.path.dirname(path)
            while parent != self.root:  # prune directories the deletion emptied
                try:
                    os.rmdir(parent)
                except OSError:
                    break
                parent = os.path.dirname(parent)
        return removed

    def make_dirs(self, rels: Iterable[str]) -> None:
        """Keys were already checked for ``..`` and absolute paths; this also stops a symlinked
        directory inside the destination from sending writes elsewhere. Every key's directories
        are checked before any is made, so a refusal leaves nothing behind."""
        rel_dirs = sorted({os.path.dirname(rel) for rel in rels} - {""})
        for rel_dir in rel_dirs:
            self._check_dir(rel_dir)
        for rel_dir in rel_dirs:
            self._make_dir(rel_dir)

    def _check_dir(self, rel_dir: str) -> None:
        """StagingError if a component of ``rel_dir`` already there is a symlink or not a directory."""
        path = self.root
        for part in rel_dir.split("/"):
            path = os.path.join(path, part)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                return  # this and what is below it are made by _make_dir
            if stat.S_ISLNK(mode):
                raise StagingError(f"destination directory {path!r} is a symbolic link (it may lead outside "
                                   f"the destination); refusing")
            if not stat.S_ISDIR(mode):
                raise StagingError(f"destination {path!r} is a file where the source has a directory; "
                                   f"remove it or stage with delete=True")

    def _make_dir(self, rel_dir: str) -> None:
        """mkdir one component at a time, each opened with O_NOFOLLOW through its parent's fd: a
        symlink swapped in after the check is refused, never followed."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        path = self.root
        try:
            for part in rel_dir.split("/"):
                path = os.path.join(path, part)
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
                try:
                    child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except OSError as e:
                    raise StagingError(f"destination directory {path!r} is no longer a plain directory "
                                       f"(a symbolic link or a file appeared); refusing") from e
                os.close(fd)
                fd = child
        except OSError as e:  # read-only, no permission, no space: said before any file is written
            raise unwritable(path, e) from e
        finally:
            os.close(fd)

    def create(self, rel: str, size: int, parts: int) -> "PosixTempFile":
        return PosixTempFile(os.path.join(self.root, rel), size, preallocate=parts > 1, fsync=self._fsync_each)

    def open_journal(self) -> M.Journal:
        return M.Journal(self.root)

    def sync(self, files: list[TempFile]) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if self._syncfs(fd) != 0:
                for f in files:  # syncfs refused: fall back to per-file fsync
                    _fsync_path(f.path)
        finally:
            os.close(fd)

    def settle(self, rels: Iterable[str]) -> None:
        for directory in {os.path.dirname(os.path.join(self.root, rel)) for rel in rels}:
            M.fsync_dir(directory)

    def needs_manifest(self) -> bool:
        return (not os.path.exists(self.manifest_path)
                or os.path.exists(os.path.join(self.root, M.JOURNAL_NAME)))

    def write_manifest(self, source: str, entries: dict[str, M.Entry]) -> None:
        M.write(self.root, source, entries)
        _unlink(os.path.join(self.root, M.JOURNAL_NAME))  # folded into the manifest just written


class PosixTempFile(TempFile):
    def __init__(self, final: str, size: int, *, preallocate: bool, fsync: bool):
        self.final = final
        self.path = os.path.join(os.path.dirname(final), M.temp_name())
        self._fsync = fsync
        self._fd = M.open_own(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        if preallocate:
            _preallocate(self._fd, size)

    def write(self, pos: int, block: Any) -> None:
        view = memoryview(block)
        while view:
            written = os.pwrite(self._fd, view, pos)
            view, pos = view[written:], pos + written

    def read(self, start: int, end: int) -> bytes:
        chunks = []
        while start < end:
            data = os.pread(self._fd, min(end - start, 1 << 24), start)
            if not data:
                raise VerifyError(f"file shorter than expected while hashing at offset {start}")
            chunks.append(data)
            start += len(data)
        return b"".join(chunks)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def land(self) -> None:
        os.rename(self.path, self.final)  # replaces a symlink planted at the final name; never follows it

    def discard(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        _unlink(self.path)


class DestinationLock:
    """An exclusive flock on the destination: two stages never write one directory at once.

    The kernel drops the lock when its holder dies (even by SIGKILL), so a rerun never waits
    on a dead stage.
    """

    def __init__(self, dest: str):
        self.path = os.path.join(dest, M.LOCK_NAME)
        self.fd = -1

    def __enter__(self) -> "DestinationLock":
        try:
            self.fd = M.open_own(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as e:  # read-only, not a directory, no permission: before anything is written
            raise unwritable(os.path.dirname(self.path), e) from e
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(self.fd)
            raise StagingError(f"another stage is writing to {os.path.dirname(self.path)!r} right now") from e
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def unwritable(path: str, e: OSError) -> DestinationError:
    """The error for a destination the OS will not let staging write (exit status 2: the user's input)."""
    return DestinationError(f"destination {path!r} cannot be written: {e.strerror or e}"
                            + (f" ({e.filename!r})" if e.filename and e.filename != path else ""))


def _syncfs() -> Any:
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
    try:
        os.unlink(path)
    except (FileNotFoundError, IsADirectoryError):
        pass
