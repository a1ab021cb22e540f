"""Read what a training job wrote into its run directory, as an untrusted tree.

The directory comes from the training task's own XCom record (dtrain.launch.job.run_record),
never from a request. Inside it, every file a rank can write is untrusted: names are matched
against fixed patterns, every path component below the run directory is opened without
following a symlink (a rank could plant ``metrics/rank0.jsonl -> /etc/shadow``), and every
read is bounded.

Stdlib only; no Airflow (the JSON API assembles the pieces, tests call these directly).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Iterator

METRICS_FILE = re.compile(r"^rank(\d{1,6})\.jsonl$")
LOG_FILE = re.compile(r"^rank(\d{1,6})\.log$")
EXIT_FILE = re.compile(r"^rank(\d{1,6})\.restart(\d{1,6})\.json$")
STACK_FILE = re.compile(r"^rank(\d{1,6})\.txt$")
CHECKPOINT = re.compile(r"^step-(\d{8})(\.pt)?$")

#: at most this much of a rank's metrics file is read (its newest part when larger)
MAX_METRICS_BYTES = 16 * 1024 * 1024
#: an exit record (40 lines of tail) is far below this
MAX_RECORD_BYTES = 1024 * 1024
#: a stack dump as the hang watcher keeps it (py-spy output is cut to 256 KiB)
MAX_STACK_BYTES = 512 * 1024
#: the end of a rank's log read for its tail
LOG_TAIL_BYTES = 64 * 1024
#: ranks looked at, whatever the directory holds (a world of 100k ranks is not drawn)
MAX_RANKS = 4096


class UnsafeRunDir(ValueError):
    """The recorded run directory is not an absolute, normalized path."""


@dataclass(frozen=True)
class Entry:
    name: str
    size: int
    mtime: float
    is_dir: bool


class RunDir:
    """One run directory, read safely (see the module docstring)."""

    def __init__(self, path: str):
        if not isinstance(path, str) or not os.path.isabs(path) or os.path.normpath(path) != path or "\0" in path:
            raise UnsafeRunDir(f"run_dir={path!r} is not an absolute, normalized path")
        self.path = path

    # -- low level ---------------------------------------------------------------------------------

    def _open(self, parts: tuple[str, ...], flags: int) -> int:
        """An fd for ``run_dir/parts...``: each part below the run directory opened with O_NOFOLLOW."""
        for part in parts:
            if part in ("", ".", "..") or "/" in part or "\0" in part:
                raise FileNotFoundError(part)
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                mode = flags if last else os.O_RDONLY | os.O_DIRECTORY
                child = os.open(part, mode | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    def read(self, *parts: str, limit: int) -> bytes | None:
        """The file's bytes; None when missing, not a regular file, a symlink, or over ``limit``."""
        try:
            fd = self._open(parts, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            data = fh.read(limit + 1)
        return data if len(data) <= limit else None

    def read_end(self, *parts: str, limit: int) -> tuple[bytes, bool]:
        """The last ``limit`` bytes of the file, and whether that is all of it (missing: b'', True)."""
        try:
            fd = self._open(parts, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return b"", True
        with os.fdopen(fd, "rb") as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode):
                return b"", True
            start = max(0, info.st_size - limit)
            fh.seek(start)
            return fh.read(limit), start == 0

    def list(self, *parts: str) -> list[Entry]:
        """The entries of a subdirectory (symlinks left out); [] when it is missing or not ours."""
        try:
            fd = self._open(parts, os.O_RDONLY | os.O_DIRECTORY) if parts else \
                os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return []
        entries = []
        try:
            with os.scandir(fd) as it:
                for item in it:
                    try:
                        info = item.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISLNK(info.st_mode):
                        continue
                    entries.append(Entry(item.name, info.st_size, info.st_mtime, stat.S_ISDIR(info.st_mode)))
        finally:
            os.close(fd)
        return entries

    def ranked(self, directory: str, pattern: re.Pattern) -> dict[int, Entry]:
        """Regular files of ``directory`` whose names match ``pattern`` (group 1: the rank), by rank."""
        found: dict[int, Entry] = {}
        for entry in self.list(directory):
            match = pattern.match(entry.name)
            if match and not entry.is_dir and len(found) < MAX_RANKS:
                found[int(match.group(1))] = entry
        return found

    # -- what a job writes -------------------------------------------------------------------------

    def metrics(self) -> dict[int, list[dict[str, Any]]]:
        """Each rank's metrics records (dtrain.training.metrics), in file order; cut lines skipped."""
        out: dict[int, list[dict[str, Any]]] = {}
        for rank, entry in sorted(self.ranked("metrics", METRICS_FILE).items()):
            data, whole = self.read_end("metrics", entry.name, limit=MAX_METRICS_BYTES)
            lines = data.split(b"\n")
            if not whole:
                lines = lines[1:]  # the first line was cut by the bound
            out[rank] = list(_records(lines))
        return out

    def exits(self) -> list[dict[str, Any]]:
        """The ranks' exit records (dtrain.launch.rank_entry) of the newest attempt."""
        records = []
        for entry in self.list("exits"):
            if EXIT_FILE.match(entry.name) and not entry.is_dir:
                raw = self.read("exits", entry.name, limit=MAX_RECORD_BYTES)
                try:
                    record = json.loads(raw) if raw else None
                except ValueError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
        return records

    def log_tails(self, lines: int) -> dict[int, list[str]]:
        """The last ``lines`` lines of each rank's log (dtrain.launch.ranklog)."""
        tails = {}
        for rank, entry in sorted(self.ranked("logs", LOG_FILE).items()):
            data, whole = self.read_end("logs", entry.name, limit=LOG_TAIL_BYTES)
            text = data.decode("utf-8", errors="replace").splitlines()
            if not whole and text:
                text = text[1:]
            tails[rank] = text[-lines:]
        return tails

    def stack_ranks(self) -> list[int]:
        """Ranks whose stack dump (dtrain.launch.hang) is on disk."""
        return sorted(self.ranked("hang", STACK_FILE))

    def stack(self, rank: int) -> str | None:
        raw = self.read("hang", f"rank{int(rank)}.txt", limit=MAX_STACK_BYTES)
        return None if raw is None else raw.decode("utf-8", errors="replace")

    def checkpoints(self) -> list[dict[str, Any]]:
        """Checkpoints (dtrain.training.checkpoint): ``step-NNNNNNNN.pt`` files, and DeepSpeed's tag
        directories under ``checkpoints/deepspeed``, oldest step first."""
        found = []
        for where in (("checkpoints",), ("checkpoints", "deepspeed")):
            for entry in self.list(*where):
                match = CHECKPOINT.match(entry.name)
                if not match or entry.is_dir != (where[-1] == "deepspeed"):
                    continue
                size = entry.size if not entry.is_dir else sum(e.size for e in self.list(*where, entry.name))
                found.append({"step": int(match.group(1)), "name": "/".join((*where[1:], entry.name)),
                              "size_bytes": size, "time": entry.mtime,
                              "kind": "deepspeed" if entry.is_dir else "torch"})
        return sorted(found, key=lambda c: (c["step"], c["name"]))


def _records(lines: list[bytes]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill, or a rank's garbage
        if isinstance(record, dict) and isinstance(record.get("step"), int) and not isinstance(record["step"], bool):
            yield record
