"""The run directory: its layout, and the one way to read or write anything under it.

Each job has a run directory on the shared filesystem (checkpoints, metrics, rank logs, exit
records, hang files, progress marks, detached nodes' status). The launcher, the trigger, the
durable worker and the UI read it, but training code (untrusted, possibly on another host) can
write anything in it: plant a symlink (``exits -> /victim``, ``metrics/result.json -> /etc/x``),
replace a file by a directory or a FIFO, write a 20 GB record. So, here and only here:

- every path component below the run directory (and the run directory itself) is opened
  without following a symlink; only regular files are read, and every read is bounded;
- files are written through a temporary file created exclusively (``O_EXCL|O_NOFOLLOW``) in
  the directory's own fd, then renamed over the name (a rename replaces a planted link, it
  never writes through it);
- a directory the product owns (``exits``, ``hang``, ``progress``, ``detached``, ``lease``) that is not a
  real directory is removed (unlinking never follows) and made again; removal is fd-based
  (``shutil.rmtree`` with ``dir_fd``), never through a link.

The rule, checked by tests/test_rundir_rule.py: no module of the package opens, lists,
stats, writes or removes a path under a run directory except through this module.

Stdlib only: the rank wrapper, the training helper, the launcher, the trigger and the UI all
import it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from typing import Any, Iterator, NamedTuple

from dtrain.atomic import atomic_write_bytes
from dtrain.errors import DTrainError

# -- layout: the names below a run directory -------------------------------------------------------

CHECKPOINTS = "checkpoints"
METRICS = "metrics"
EXITS = "exits"
HANG = "hang"
PROGRESS = "progress"
LOGS = "logs"
DETACHED = "detached"
#: a Slurm node's lease: its heartbeat and its fence record (dtrain.launch.node.lease)
LEASE = "lease"
#: rank 0's result (dtrain.training.metrics.write_result), under METRICS
RESULT = "result.json"
#: the resolved DeepSpeed config the launcher hands every rank
DEEPSPEED_CONFIG = "deepspeed_config.json"
#: who launched this run directory (dag, run, task, try): written by the launcher before any rank
#: starts, read by the UI before it shows anything of the directory (XCom is not provenance)
MARKER = ".dtrain-run.json"

METRICS_FILE = re.compile(r"^rank(\d{1,6})\.jsonl$")
LOG_FILE = re.compile(r"^rank(\d{1,6})\.log$")
EXIT_FILE = re.compile(r"^rank(\d{1,6})\.restart(\d{1,6})\.json$")
STACK_FILE = re.compile(r"^rank(\d{1,6})\.txt$")
CHECKPOINT = re.compile(r"^step-(\d{8})(\.pt)?$")

# -- a DCP checkpoint's commit marker and a remote location's index of them ------------------------
# dtrain.training.dcp writes them, RunDir.checkpoints lists what they describe: the format is here

#: a DCP checkpoint's folder under the location's DCP_FOLDER
STEP_DIR = re.compile(r"step-(\d{8})")
#: written last, by rank 0, in a checkpoint's folder: without it the folder is a save cut short
DCP_MARKER = "dtrain-commit.json"
#: in the run directory's checkpoints folder: the complete checkpoints of a remote location
DCP_INDEX = "remote.json"
#: the folder under the checkpoint location that holds DCP checkpoints
DCP_FOLDER = "dcp"


class Committed(NamedTuple):
    """A complete checkpoint, as its commit marker describes it."""

    step: int
    world_size: int
    time: float
    metric: float | None = None

    @property
    def name(self) -> str:
        return step_name(self.step)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_marker(name: str, data: bytes | None) -> Committed | None:
    """The marker of folder ``name``, or None when it is missing or not one this code wrote
    (storage is shared: anything may be there)."""
    if data is None:
        return None
    try:
        record = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return commit_record(name, record)


def commit_record(name: str, record: Any) -> Committed | None:
    """A marker's (or the remote index's) record of checkpoint folder ``name``, checked whole:
    its step is the folder's, a positive world size, a time, a finite metric or none."""
    match = STEP_DIR.fullmatch(name) if isinstance(name, str) else None
    if match is None or not isinstance(record, dict):
        return None
    step, world, when, metric = (record.get(k) for k in ("step", "world_size", "time", "metric"))
    if not (_is_int(step) and step == int(match.group(1)) and _is_int(world) and world > 0
            and isinstance(when, (int, float)) and not isinstance(when, bool) and math.isfinite(when)):
        return None
    if metric is not None and not (isinstance(metric, (int, float)) and not isinstance(metric, bool)
                                   and math.isfinite(metric)):
        return None
    return Committed(step=step, world_size=world, time=float(when), metric=None if metric is None else float(metric))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- reading limits --------------------------------------------------------------------------------

#: at most this much of a rank's metrics file is read (its newest part when larger)
MAX_METRICS_BYTES = 16 * 1024 * 1024
#: an exit record (40 lines of tail) is far below this
MAX_RECORD_BYTES = 1024 * 1024
#: a stack dump as the hang watcher keeps it (py-spy output is cut to 256 KiB)
MAX_STACK_BYTES = 512 * 1024
#: rank 0's result, the marker, a status record: small JSON objects
MAX_SMALL_JSON_BYTES = 1024 * 1024
#: the end of a rank's log read for its tail
LOG_TAIL_BYTES = 64 * 1024
#: a DCP checkpoint's commit marker is a small JSON object
MAX_CHECKPOINT_MARKER_BYTES = 64 * 1024
#: entries of a remote location's checkpoint index looked at
MAX_REMOTE_CHECKPOINTS = 1000
#: ranks looked at, whatever the directory holds (a world of 100k ranks is not drawn)
MAX_RANKS = 4096
#: names a reader that shows a directory (the UI: ``RunDir(max_listed=...)``) reads from one folder: a
#: rank's 4096 files and what else the product keeps beside them, with room to spare; past it the
#: names are only counted, up to as many again (a rank that plants 300,000 files costs a page refresh
#: this many names, not 300,000 stats)
MAX_LISTED = 2 * MAX_RANKS

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeRunDir(DTrainError, ValueError):
    """The run directory, or a directory the product owns inside it, is not what it must be
    (not an absolute normalized path, a symlink, not a directory)."""


class Entry(NamedTuple):
    name: str
    size: int
    mtime: float
    is_dir: bool
    mtime_ns: int = 0
    ctime: float = 0.0
    #: the file's identity: a follower of a growing file tells a replaced file from a grown one
    ino: int = 0


class Unread(NamedTuple):
    """A folder a listing stopped short of: ``read`` names read, ``more`` names after them not read
    (all of them when ``counted_all``, else at least that many)."""

    read: int
    more: int
    counted_all: bool


def _entry(item: os.DirEntry) -> Entry | None:
    """A scandir item as an :class:`Entry`, never following a link (None: a link, or gone)."""
    try:
        info = item.stat(follow_symlinks=False)
    except OSError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return None
    return Entry(item.name, info.st_size, info.st_mtime, stat.S_ISDIR(info.st_mode), info.st_mtime_ns,
                 info.st_ctime, info.st_ino)


def _normalized(path: Any) -> bool:
    return isinstance(path, str) and os.path.isabs(path) and os.path.normpath(path) == path and "\0" not in path


def _check_part(part: str) -> None:
    if not isinstance(part, str) or part in ("", ".", "..") or "/" in part or "\0" in part:
        raise FileNotFoundError(f"not a name below a run directory: {part!r}")


class RunDir:
    """One run directory, read and written safely (see the module docstring).

    ``below``: a configured root the run directory must lie under (a reader that takes the path
    from a record anyone may edit: the UI). The root itself is trusted and followed (``/fsx`` may be
    a link to the mount); every component from it down to the run directory is opened without
    following a symlink, so the directory read is the one the path names, not one a link leads to.
    """

    def __init__(self, path: str, *, below: str | None = None, max_listed: int | None = None):
        if not _normalized(path):
            raise UnsafeRunDir(f"run_dir={path!r} is not an absolute, normalized path")
        if below is not None and not (_normalized(below) and path != below
                                      and os.path.commonpath([below, path]) == below):
            raise UnsafeRunDir(f"run_dir={path!r} is not below {below!r}")
        self.path = path
        self.below = below
        #: names read from one folder at most (None: all; the launcher must see every exit record)
        self.max_listed = max_listed
        #: folders a listing stopped short of, by name ("." the run directory): see :class:`Unread`
        self.unread: dict[str, Unread] = {}

    def __repr__(self) -> str:
        return f"RunDir({self.path!r})"

    def join(self, *parts: str) -> str:
        """The path of ``parts`` (for messages, and for the env handed to ranks): never opened."""
        return os.path.join(self.path, *parts)

    # -- low level ---------------------------------------------------------------------------------

    def _root(self) -> int:
        try:
            if self.below is None:
                return os.open(self.path, _DIR_FLAGS)
            fd = os.open(self.below, _DIR_FLAGS & ~os.O_NOFOLLOW)
            try:
                for part in os.path.relpath(self.path, self.below).split(os.sep):
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    os.close(fd)
                    fd = child
            except BaseException:
                os.close(fd)
                raise
            return fd
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeRunDir(f"run_dir={self.path!r} is a symlink or not a directory: refusing it") from exc
            raise

    def _dir(self, parts: tuple[str, ...]) -> int:
        """An fd for the directory ``run_dir/parts...``, every component opened without following."""
        for part in parts:
            _check_part(part)
        fd = self._root()
        try:
            for part in parts:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _open(self, parts: tuple[str, ...], flags: int, mode: int = 0o644) -> int:
        """An fd for ``run_dir/parts...``: each part opened with O_NOFOLLOW."""
        if not parts:
            raise FileNotFoundError("no file named")
        _check_part(parts[-1])
        parent = self._dir(parts[:-1])
        try:
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
        finally:
            os.close(parent)

    # -- reading -----------------------------------------------------------------------------------

    def _open_file(self, parts: tuple[str, ...]) -> int | None:
        """A read-only fd for the regular file ``run_dir/parts...``; None when it is missing, a
        symlink, or anything but a regular file. Checked on the fd before ``os.fdopen``, which
        raises IsADirectoryError for a directory planted in the file's place."""
        try:
            fd = self._open(parts, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    def read(self, *parts: str, limit: int) -> bytes | None:
        """The file's bytes; None when missing, not a regular file, a symlink, or over ``limit``."""
        fd = self._open_file(parts)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(limit + 1)
        return data if len(data) <= limit else None

    def read_json(self, *parts: str, limit: int = MAX_SMALL_JSON_BYTES) -> Any:
        """The file's JSON value; None when it cannot be read (see :meth:`read`) or is not JSON."""
        raw = self.read(*parts, limit=limit)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # garbage, or [[[[... a million deep
            return None

    def read_end(self, *parts: str, limit: int) -> tuple[bytes, bool]:
        """The last ``limit`` bytes of the file, and whether that is all of it (missing: b'', True)."""
        fd = self._open_file(parts)
        if fd is None:
            return b"", True
        with os.fdopen(fd, "rb") as fh:
            info = os.fstat(fh.fileno())
            start = max(0, info.st_size - limit)
            fh.seek(start)
            return fh.read(limit), start == 0

    def read_from(self, *parts: str, offset: int, limit: int) -> tuple[bytes, int] | None:
        """Up to ``limit`` bytes from ``offset``, and the file's size now; None when the file cannot
        be read (missing, a symlink, not a regular file). A follower of a growing log reads this way."""
        fd = self._open_file(parts)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as fh:
            info = os.fstat(fh.fileno())
            fh.seek(min(offset, info.st_size))
            return fh.read(limit), info.st_size

    def stat(self, *parts: str) -> os.stat_result | None:
        """The entry's own status (a symlink is not followed: its own status); None when missing."""
        if not parts:
            try:
                return os.stat(self.path, follow_symlinks=False)
            except OSError:
                return None
        try:
            _check_part(parts[-1])
            parent = self._dir(parts[:-1])
        except OSError:
            return None
        try:
            return os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        except OSError:
            return None
        finally:
            os.close(parent)

    def is_file(self, *parts: str) -> bool:
        info = self.stat(*parts)
        return info is not None and stat.S_ISREG(info.st_mode)

    def list(self, *parts: str, match: re.Pattern | None = None, keep: int | None = None) -> list[Entry]:
        """The entries of a subdirectory (symlinks left out); [] when it is missing or not ours.

        ``match``: only names it matches are looked at (a name is read before anything is stat'd).
        Reading stops after :attr:`max_listed` names or ``keep`` entries; the rest of the folder is
        then counted, not read (up to as many names again), and recorded in :attr:`unread`."""
        try:
            fd = self._dir(parts)
        except OSError:
            return []
        entries: list[Entry] = []
        read = 0
        try:
            with os.scandir(fd) as it:
                for item in it:
                    if read == self.max_listed or len(entries) == keep:
                        self._note_unread(parts, read, it)
                        break
                    read += 1
                    if match is None or match.match(item.name):
                        entry = _entry(item)
                        if entry is not None:
                            entries.append(entry)
        finally:
            os.close(fd)
        return entries

    def _note_unread(self, parts: tuple[str, ...], read: int, rest: Iterator[os.DirEntry]) -> None:
        """Count the names a listing did not read (the one in hand and the rest), at most ``read``."""
        more = 1 + sum(1 for _ in zip(range(read - 1), rest))
        self.unread["/".join(parts) or "."] = Unread(read=read, more=more, counted_all=next(rest, None) is None)

    def ranked(self, directory: str, pattern: re.Pattern) -> dict[int, Entry]:
        """Regular files of ``directory`` whose names match ``pattern`` (group 1: the rank), by rank;
        at most :data:`MAX_RANKS` of them."""
        found: dict[int, Entry] = {}
        for entry in self.list(*([directory] if directory else []), match=pattern, keep=MAX_RANKS):  # "": the run dir
            if not entry.is_dir:
                found[int(pattern.match(entry.name).group(1))] = entry
        return found

    # -- writing -----------------------------------------------------------------------------------

    def ensure_dir(self, *parts: str, owned: bool = True) -> None:
        """Make ``run_dir/parts...`` a real directory (the run directory itself too).

        A component that exists but is a symlink or not a directory: when ``owned`` (a directory
        only the product writes: exits, hang, progress, detached) it is removed, never followed,
        and made again; otherwise :class:`UnsafeRunDir` is raised naming it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)  # above the run dir: configured, trusted
        try:
            os.mkdir(self.path, 0o755)
        except FileExistsError:
            pass
        for part in parts:
            _check_part(part)
        fd = self._root()
        try:
            for i, part in enumerate(parts):
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass  # another node of the job made it just now (they start at once)
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    if not owned:
                        raise UnsafeRunDir(f"{self.join(*parts[:i + 1])} is not a directory (a symlink or a "
                                           "file planted in the run directory): refusing to use it") from exc
                    os.unlink(part, dir_fd=fd)  # a link or a file: removing it never follows it
                    os.mkdir(part, 0o755, dir_fd=fd)
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
        finally:
            os.close(fd)

    def write(self, *parts: str, data: bytes, mode: int = 0o644) -> str:
        """Write ``data`` to ``run_dir/parts...`` atomically: an exclusive, no-follow temporary file
        in the same directory, then a rename over the name. Missing directories are made (a planted
        link where one should be raises :class:`UnsafeRunDir`). Returns the path written."""
        if not parts:
            raise FileNotFoundError("no file named")
        _check_part(parts[-1])
        self.ensure_dir(*parts[:-1], owned=False)
        parent = self._dir(parts[:-1])
        try:
            # No fsync: a record here (a status, an exit record, a script) matters while the job lives;
            # the rename alone makes it whole, without an fsync per record on a shared filesystem.
            atomic_write_bytes(parts[-1], data, dir_fd=parent, mode=mode, fsync=False, fsync_dir=False)
        finally:
            os.close(parent)
        return self.join(*parts)

    def write_json(self, *parts: str, value: Any, mode: int = 0o644, indent: int | None = None) -> str:
        return self.write(*parts, data=json.dumps(value, indent=indent, sort_keys=indent is not None).encode(),
                          mode=mode)

    def open_append(self, *parts: str, mode: int = 0o644) -> int:
        """An fd to append to ``run_dir/parts...`` (created when missing), never through a link.
        Non-blocking open: a FIFO planted in the file's place fails at once instead of blocking."""
        self.ensure_dir(*parts[:-1], owned=False)
        fd = self._open(parts, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, mode)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafeRunDir(f"{self.join(*parts)} is not a regular file")
        return fd

    def touch(self, *parts: str) -> None:
        """Create the file or set its times to now, never through a link (a progress mark)."""
        fd = self._open(parts, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK)
        try:
            os.utime(fd)
        finally:
            os.close(fd)

    def remove(self, *parts: str) -> bool:
        """Remove the entry (a file, a link itself, or a directory tree, fd-based: never through a
        link); False when it was not there."""
        _check_part(parts[-1] if parts else "")
        try:
            parent = self._dir(parts[:-1])
        except OSError:
            return False
        try:
            try:
                info = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if stat.S_ISDIR(info.st_mode):
                import shutil  # only here: every rank's wrapper imports this module

                shutil.rmtree(parts[-1], dir_fd=parent)
            else:
                os.unlink(parts[-1], dir_fd=parent)
            return True
        finally:
            os.close(parent)

    def clear(self, *parts: str) -> None:
        """Make ``run_dir/parts...`` an empty real directory (an owned one: see :meth:`ensure_dir`):
        whatever an earlier attempt or a rank left there is removed, nothing outside is touched."""
        self.ensure_dir(*parts, owned=True)
        for entry in self._names(parts):
            self.remove(*parts, entry)

    def _names(self, parts: tuple[str, ...]) -> list[str]:
        fd = self._dir(parts)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    # -- what a job writes -------------------------------------------------------------------------

    def metrics(self) -> dict[int, list[dict[str, Any]]]:
        """Each rank's metrics records (dtrain.training.metrics), in file order; cut lines skipped."""
        return {rank: [r for r in records if _has_step(r)] for rank, records in self.ranked_jsonl(METRICS).items()}

    def ranked_jsonl(self, directory: str = METRICS, limit: int = MAX_METRICS_BYTES) -> dict[int, list[dict[str, Any]]]:
        """Each rank's JSON-lines records (``rank<R>.jsonl`` in ``directory``; "": the run directory
        itself), the newest ``limit`` bytes of each file; lines that are not an object skipped."""
        out: dict[int, list[dict[str, Any]]] = {}
        where = (directory,) if directory else ()
        for rank, entry in sorted(self.ranked(directory, METRICS_FILE).items()):
            data, whole = self.read_end(*where, entry.name, limit=min(limit, MAX_METRICS_BYTES))
            lines = data.split(b"\n")
            if not whole:
                lines = lines[1:]  # the first line was cut by the bound
            out[rank] = list(_records(lines))
        return out

    def result(self) -> dict[str, Any]:
        """Rank 0's result (``metrics/result.json``): a JSON object, else {}."""
        value = self.read_json(METRICS, RESULT)
        return value if isinstance(value, dict) else {}

    def exits(self) -> list[dict[str, Any]]:
        """The ranks' exit records (dtrain.launch.node.rank_entry) of the newest attempt."""
        records = []
        for entry in self.list(EXITS):
            if EXIT_FILE.match(entry.name) and not entry.is_dir:
                record = self.read_json(EXITS, entry.name, limit=MAX_RECORD_BYTES)
                if isinstance(record, dict):
                    records.append(record)
        return records

    def log_tails(self, lines: int) -> dict[int, list[str]]:
        """The last ``lines`` lines of each rank's log (dtrain.launch.node.ranklog)."""
        tails = {}
        for rank, entry in sorted(self.ranked(LOGS, LOG_FILE).items()):
            tails[rank] = self.tail(LOGS, entry.name, lines=lines, limit=LOG_TAIL_BYTES)
        return tails

    def tail(self, *parts: str, lines: int, limit: int = 256 * 1024) -> list[str]:
        """The last ``lines`` lines of a (possibly large, growing) text file; [] when unreadable."""
        data, whole = self.read_end(*parts, limit=limit)
        text = data.decode("utf-8", errors="replace").splitlines()
        if not whole and text:
            text = text[1:]  # cut by the bound
        return text[-lines:]

    def stack_ranks(self) -> list[int]:
        """Ranks whose stack dump (dtrain.launch.node.hang_files) is on disk."""
        return sorted(self.ranked(HANG, STACK_FILE))

    def stack(self, rank: int) -> str | None:
        raw = self.read(HANG, f"rank{int(rank)}.txt", limit=MAX_STACK_BYTES)
        return None if raw is None else raw.decode("utf-8", errors="replace")

    def checkpoints(self) -> list[dict[str, Any]]:
        """Checkpoints (dtrain.training.checkpoint): ``step-NNNNNNNN.pt`` files, DeepSpeed's tag
        directories under ``checkpoints/deepspeed``, complete DCP checkpoints (with their commit
        marker) under ``checkpoints/dcp``, and those of a remote (s3://) location as its index here
        lists them; oldest step first."""
        found = []
        for where in ((CHECKPOINTS,), (CHECKPOINTS, "deepspeed")):
            for entry in self.list(*where):
                match = CHECKPOINT.match(entry.name)
                if not match or entry.is_dir != (where[-1] == "deepspeed"):
                    continue
                size = entry.size if not entry.is_dir else sum(e.size for e in self.list(*where, entry.name))
                found.append({"step": int(match.group(1)), "name": "/".join((*where[1:], entry.name)),
                              "size_bytes": size, "time": entry.mtime,
                              "kind": "deepspeed" if entry.is_dir else "torch"})
        found += self._dcp_checkpoints() + self._remote_checkpoints()
        return sorted(found, key=lambda c: (c["step"], c["name"]))

    def _dcp_checkpoints(self) -> list[dict[str, Any]]:
        found = []
        for entry in self.list(CHECKPOINTS, DCP_FOLDER):
            data = entry.is_dir and self.read(CHECKPOINTS, DCP_FOLDER, entry.name, DCP_MARKER,
                                              limit=MAX_CHECKPOINT_MARKER_BYTES)
            marker = entry.is_dir and parse_marker(entry.name, data)
            if marker:  # complete: a folder without its marker is a save cut short, never listed
                found.append({"step": marker.step, "name": f"{DCP_FOLDER}/{entry.name}", "kind": "dcp",
                              "size_bytes": sum(e.size for e in self.list(CHECKPOINTS, DCP_FOLDER, entry.name)),
                              "time": marker.time, "world_size": marker.world_size})
        return found

    def _remote_checkpoints(self) -> list[dict[str, Any]]:
        """The index rank 0 keeps of a remote location's complete checkpoints (shown, never fetched)."""
        from dtrain.grammar import CHECKPOINT_URL

        index = self.read_json(CHECKPOINTS, DCP_INDEX)
        if not isinstance(index, dict) or not isinstance(index.get("location"), str) \
                or not CHECKPOINT_URL.fullmatch(index["location"]) or not isinstance(index.get("checkpoints"), list):
            return []
        found = []
        for record in index["checkpoints"][:MAX_REMOTE_CHECKPOINTS]:
            step, size = (record.get(k) for k in ("step", "size_bytes")) if isinstance(record, dict) else (None, None)
            marker = commit_record(step_name(step), record) if isinstance(step, int) and 0 <= step < 10**8 else None
            if marker is not None:
                found.append({"step": marker.step, "name": f"{index['location']}/{marker.name}", "kind": "dcp",
                              "size_bytes": size if isinstance(size, int) and size >= 0 else None,
                              "time": marker.time, "world_size": marker.world_size})
        return found


def _records(lines: list[bytes]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line cut by a kill, or a rank's garbage
        if isinstance(record, dict):
            yield record


def _has_step(record: dict[str, Any]) -> bool:
    return isinstance(record.get("step"), int) and not isinstance(record["step"], bool)


# -- the run directory's marker: who launched it (the UI's check: dtrain.ui.provenance) ------------

def run_dir_or_none(run_dir: str) -> "RunDir | None":
    """``RunDir(run_dir)``, or None when it is not a safe run directory (a reader that has nothing to
    say about such a directory: hang and exit records)."""
    try:
        return RunDir(run_dir)
    except UnsafeRunDir:
        return None


def marker_of(ti: Any, run_dir: str) -> dict[str, Any]:
    """What the training operator writes: the task instance's identity and try, and the directory's path."""
    map_index = getattr(ti, "map_index", None)
    return {"dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id,
            "map_index": -1 if map_index is None else int(map_index), "try_number": int(ti.try_number),
            "run_dir": run_dir}


def write_marker(run_dir: str, ti: Any) -> None:
    """Mark ``run_dir`` as launched by ``ti`` (before any rank starts; written exclusively, renamed
    over, never through a link planted at the name)."""
    RunDir(run_dir).write_json(MARKER, value=marker_of(ti, run_dir))
