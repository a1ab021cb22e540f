"""Each rank's output, also kept in ``<run_dir>/logs/rank<R>.log`` (as torchrun's ``--log-dir``).

The task log interleaves every rank; a person looking at one rank (the Training tab's live
tails, ``tail -f`` on the shared filesystem) wants that rank alone. The per-rank wrapper
(dtrain.launch.node.rank_entry) writes every line it forwards here too.

Bounded: past :data:`MAX_BYTES` the file is rotated to ``rank<R>.log.1`` (one old file kept),
so a rank printing without end cannot fill the shared filesystem. Opened without following a
symlink: the run directory may be shared with other users' jobs.

Stdlib only: on every rank's start-up path.
"""

from __future__ import annotations

import os
import threading
import time

LOGS_DIR = "logs"
#: a rank's log is rotated past this many bytes (one previous file is kept)
MAX_BYTES = 16 * 1024 * 1024
MAX_BYTES_ENV = "DTRAIN_RANK_LOG_MAX_BYTES"


def logs_dir(run_dir: str) -> str:
    return os.path.join(run_dir, LOGS_DIR)


def log_path(run_dir: str, rank: int | str) -> str:
    return os.path.join(logs_dir(run_dir), f"rank{rank}.log")


def _open_append(name: str, dir_fd: int) -> int:
    return os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                   dir_fd=dir_fd)


class RankLog:
    """Appends a rank's output lines to its log file; safe from the stdout and stderr pumps at once.

    Never raises: a full or unwritable filesystem must not take the rank down with it (the
    task log still has every line)."""

    def __init__(self, run_dir: str, rank: int | str, header: str = "", max_bytes: int | None = None):
        self.path = log_path(run_dir, rank)
        self.name = os.path.basename(self.path)
        self.max_bytes = max_bytes if max_bytes is not None else _max_bytes()
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._dir_fd: int | None = None
        self._size = 0
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            # The logs folder too is opened without following a link: a planted logs -> elsewhere
            # would have this rank write (and rotate) files in a folder of someone else's choosing.
            self._dir_fd = os.open(os.path.dirname(self.path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            self._fd = _open_append(self.name, self._dir_fd)
            self._size = os.fstat(self._fd).st_size
        except OSError:
            self.close_locked()
        if header:
            self.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%S%z')} {header}\n".encode())

    def write(self, line: bytes) -> None:
        with self._lock:
            if self._fd is None:
                return
            try:
                if self._size + len(line) > self.max_bytes:
                    self._rotate()
                os.write(self._fd, line)
                self._size += len(line)
            except OSError:
                self.close_locked()

    def _rotate(self) -> None:
        os.close(self._fd)
        self._fd = None
        os.replace(self.name, self.name + ".1", src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        self._fd = _open_append(self.name, self._dir_fd)
        self._size = 0

    def close_locked(self) -> None:
        for fd in (self._fd, self._dir_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd = self._dir_fd = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()


def _max_bytes() -> int:
    try:
        return max(4096, int(os.environ.get(MAX_BYTES_ENV, MAX_BYTES)))
    except ValueError:
        return MAX_BYTES
