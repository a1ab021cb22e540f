"""Reading growing log files: the last lines (bounded), and ``tail -f`` for a follower."""

from __future__ import annotations

import os
from typing import Callable

TAIL_LINES = 40


def read_tail(path: str, lines: int = TAIL_LINES, max_bytes: int = 256 * 1024) -> list[str]:
    """The last ``lines`` lines of a (possibly large) log file; [] if it does not exist yet."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-lines:]


class LogFollower:
    """Emit the new complete lines of a growing log file, like ``tail -f``."""

    def __init__(self, path: str, sink: Callable[[str], None]):
        self.path = path
        self.sink = sink
        self.offset = 0
        self.partial = b""

    def poll(self, final: bool = False) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        for line in lines:
            self.sink(line.decode(errors="replace"))
