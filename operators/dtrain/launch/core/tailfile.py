"""Reading growing log files in a run directory: the last lines (bounded), and ``tail -f`` for a
follower. The files are written by Slurm or a node daemon, but a rank can replace them with a
link (to a file with credentials, say): both read through :class:`dtrain.rundir.RunDir`, so the
file and its directory are opened without following links, and each read is bounded."""

from __future__ import annotations

import os
from typing import Callable

from dtrain.rundir import RunDir, UnsafeRunDir

TAIL_LINES = 40
#: a follower reads at most this much per call (a rank that prints gigabytes costs no more memory)
FOLLOW_CHUNK_BYTES = 1024 * 1024
#: a "line" with no newline for this long is emitted in pieces
MAX_LINE_BYTES = 64 * 1024


def _split(path: str) -> tuple[RunDir, str]:
    return RunDir(os.path.dirname(path)), os.path.basename(path)


def read_tail(path: str, lines: int = TAIL_LINES, max_bytes: int = 256 * 1024) -> list[str]:
    """The last ``lines`` lines of a (possibly large) log file; [] if it does not exist yet or is
    not a regular file (a link is not followed)."""
    try:
        directory, name = _split(path)
        return directory.tail(name, lines=lines, limit=max_bytes)
    except (UnsafeRunDir, OSError):
        return []


class LogFollower:
    """Emit the new complete lines of a growing log file, like ``tail -f``."""

    def __init__(self, path: str, sink: Callable[[str], None]):
        self.path = path
        self.sink = sink
        self.offset = 0
        self.partial = b""

    def poll(self, final: bool = False) -> None:
        """Emit what was appended since the last call (everything, when ``final``), a bounded chunk
        at a time."""
        while True:
            try:
                directory, name = _split(self.path)
                got = directory.read_from(name, offset=self.offset, limit=FOLLOW_CHUNK_BYTES)
            except (UnsafeRunDir, OSError):
                got = None
            data = got[0] if got is not None else b""
            self.offset += len(data)
            self._emit(data)
            if not data or len(data) < FOLLOW_CHUNK_BYTES:
                break
        if final and self.partial:
            self.sink(self.partial.decode(errors="replace"))
            self.partial = b""

    def _emit(self, data: bytes) -> None:
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        while len(self.partial) > MAX_LINE_BYTES:
            lines.append(self.partial[:MAX_LINE_BYTES])
            self.partial = self.partial[MAX_LINE_BYTES:]
        for line in lines:
            self.sink(line.decode(errors="replace"))
