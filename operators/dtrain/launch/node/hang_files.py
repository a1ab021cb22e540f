"""The ranks' side of hang detection: the files through which a rank and the hang watcher talk.

Under the run directory, shared by every node: ``progress/rank<R>`` (touched while the rank makes
progress), ``progress/rank<R>.started`` (touched when its wrapper starts it: a start is not progress,
the watcher gives a starting rank longer), ``hang/request`` (the watcher asks every rank for its
stack), ``hang/rank<R>.txt`` and ``hang/rank<R>.fr.json`` (the rank's stacks and torch's flight
recorder). The per-rank wrapper (:mod:`dtrain.launch.node.rank_entry`) and the training helper
(:mod:`dtrain.training.watchdog`) write them; the watcher, :mod:`dtrain.launch.engine.hang`, reads
them and decides.

Stdlib and dtrain.rundir only: on every rank's start-up path, on hosts that may have no Airflow.
"""

from __future__ import annotations

import os
import threading
import time

from dtrain.rundir import HANG, PROGRESS, RunDir, UnsafeRunDir

#: a rank's wrapper waits this long for the in-process dump before it falls back to py-spy
HELPER_DUMP_WAIT_S = 5.0
#: an outside stack dump (py-spy) keeps at most this many characters
MAX_STACK_CHARS = 256 * 1024

HANG_DIR_ENV = "DTRAIN_HANG_DIR"
PROGRESS_DIR_ENV = "DTRAIN_PROGRESS_DIR"


def hang_dir(run_dir: str) -> str:
    return os.path.join(run_dir, HANG)


def progress_dir(run_dir: str) -> str:
    return os.path.join(run_dir, PROGRESS)


def request_path(directory: str) -> str:
    return os.path.join(directory, "request")


def stack_path(directory: str, rank: int | str) -> str:
    return os.path.join(directory, f"rank{rank}.txt")


def flight_recorder_path(directory: str, rank: int | str) -> str:
    return os.path.join(directory, f"rank{rank}.fr.json")


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, never through a symlink someone planted (the file
    and its directory): :meth:`dtrain.rundir.RunDir.write`, private to the user."""
    RunDir(os.path.dirname(path)).write(os.path.basename(path), data=data, mode=0o600)


def exists(path: str) -> bool:
    """Whether ``path`` (a file in a hang directory) exists, itself not followed, its directory
    opened without following a link: how a rank sees the request and its own dump."""
    if not os.path.isabs(path):
        return False
    try:
        return RunDir(os.path.dirname(os.path.normpath(path))).stat(os.path.basename(path)) is not None
    except UnsafeRunDir:
        return False


def started_name(rank: int | str) -> str:
    """The file (in the progress directory) whose status-change time is when the rank last (re)started."""
    return f"rank{rank}.started"


def mark_started(directory: str, rank: int | str) -> None:
    """Record that the rank's wrapper (re)started it."""
    touch_mark(directory, started_name(rank))


def touch_mark(directory: str, name: str) -> None:
    """Create ``directory/name`` or set its times to now, never through a link: the watcher reads
    its status-change time. Marking must never break a rank: a failure is ignored."""
    try:
        run = RunDir(directory)
        run.ensure_dir(owned=False)
        run.touch(name)
    except (OSError, ValueError):
        pass


class ProgressToucher:
    """Marks a rank as making progress: touches ``<progress dir>/rank<R>`` at most once per
    ``every`` seconds (an mtime the watcher reads), so a chatty rank costs one syscall a second."""

    def __init__(self, directory: str, rank: int | str, every: float = 1.0):
        self.path = os.path.join(directory, f"rank{rank}")
        self.every = every
        self._last = float("-inf")
        self._lock = threading.Lock()

    def touch(self) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.every:
                return
            self._last = now
        touch_mark(os.path.dirname(self.path), os.path.basename(self.path))
