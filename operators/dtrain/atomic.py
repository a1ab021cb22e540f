"""The one atomic file write: a new file appears whole under its name, or the old one stays.

The bytes go to a temporary file made in the target's own directory, created exclusively and
without following a link (``O_CREAT|O_EXCL|O_NOFOLLOW``: nothing planted at the temporary name is
written through), flushed and fsynced, then renamed over the name. A rename replaces whatever is
at the name, a planted symlink included, and never writes through it. The directory is fsynced
last, so the new name survives a power loss too. On any exception the temporary file is removed
and the old file is left as it was.

A caller that already holds the directory open (:class:`dtrain.rundir.RunDir`, which opens every
component of a run directory without following a link) passes ``dir_fd`` and a bare name: every
step is then relative to that descriptor.

Stdlib only: the rank wrapper, the training helper, staging and preprocessing all import it.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from typing import BinaryIO, Callable, Iterator

#: errors a filesystem answers when it cannot fsync a directory at all: the rename is still atomic
_DIR_FSYNC_REFUSED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def temp_name(name: str) -> str:
    """A hidden temporary name beside ``name`` that nobody can predict (pid plus a random token)."""
    return f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"


@contextmanager
def atomic_open(path: str, *, dir_fd: int | None = None, mode: int = 0o644, temp: str | None = None,
                opener: Callable[[str, int], int] | None = None, fsync: bool = True,
                fsync_dir: bool = True) -> Iterator[BinaryIO]:
    """A binary file object whose content replaces ``path`` when the block ends without an exception.

    Args:
        path: the file to replace; with ``dir_fd``, a bare name in that directory.
        dir_fd: a directory descriptor every step is relative to (not closed here).
        mode: the new file's permissions (before the umask, as ``os.open`` takes them).
        temp: the temporary file's name in the same directory (default: :func:`temp_name`).
        opener: ``opener(temp_path, flags) -> fd`` instead of ``os.open`` (as the built-in ``open``
            takes one), for a caller's own checks and refusal messages; it gets the exclusive,
            no-follow flags and must keep them. Not with ``dir_fd``.
        fsync: fsync the file before the rename (off only where the caller never needed durability).
        fsync_dir: fsync the directory after the rename.
    """
    directory, name = os.path.split(path)
    if dir_fd is not None and (directory or opener is not None):
        raise ValueError(f"with dir_fd, {path!r} must be a bare name in that directory, and no opener")
    tmp_name = temp or temp_name(name)
    tmp = tmp_name if dir_fd is not None else os.path.join(directory, tmp_name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = opener(tmp, flags) if opener is not None else os.open(tmp, flags, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as fh:
            fd = -1  # the file object owns it now
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        _unlink_quietly(tmp, dir_fd)
        raise
    if fsync_dir:
        if dir_fd is not None:
            _fsync_fd(dir_fd)
        else:
            fsync_directory(directory or ".")


def atomic_write_bytes(path: str, data: bytes, **options) -> None:
    """Replace ``path`` with ``data`` atomically (:func:`atomic_open`'s options)."""
    with atomic_open(path, **options) as fh:
        fh.write(data)


def fsync_directory(directory: str) -> None:
    """Make a rename or unlink in ``directory`` durable (its entries, not only a file's data).

    A directory that cannot be opened, or a filesystem that refuses to fsync one, is let be: the
    rename itself is atomic either way. Any other error (EIO) is raised."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        _fsync_fd(fd)
    finally:
        os.close(fd)


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _DIR_FSYNC_REFUSED:
            raise


def _unlink_quietly(path: str, dir_fd: int | None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass
