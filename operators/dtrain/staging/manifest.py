"""The destination's manifest: what was staged, written last and atomically.

``.dtrain-manifest.json`` says the directory is complete and what each file is
(relative path, size, ETag or change token, version id, checksum). While a stage
runs, each file renamed into place is appended to ``.dtrain-manifest.journal``, so
a stage killed with SIGKILL resumes without refetching what already landed. The
journal is folded into the manifest and removed at the end.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from dtrain.atomic import atomic_write_bytes
from dtrain.atomic import fsync_directory as fsync_dir  # noqa: F401 (the POSIX destination's settle)
from dtrain.staging.errors import DestinationError

MANIFEST_NAME = ".dtrain-manifest.json"
JOURNAL_NAME = ".dtrain-manifest.journal"
LOCK_NAME = ".dtrain-stage.lock"
TMP_PREFIX = ".dtrain-tmp-"
FORMAT = "dtrain-staging-manifest/1"
# Staging's own files at the top of a destination: never reported as staged files.
RESERVED_NAMES = (MANIFEST_NAME, JOURNAL_NAME, LOCK_NAME)


@dataclass
class Entry:
    size: int
    token: str
    etag: str | None = None
    version_id: str | None = None
    checksum: str | None = None   # "md5:<hex>", "etag:<multipart etag>", "sha256:<b64>" ...


def temp_name() -> str:
    """A hidden temporary file name nobody can predict, so nobody can plant anything there first."""
    return f"{TMP_PREFIX}{uuid.uuid4().hex[:16]}"


def open_own(path: str, flags: int) -> int:
    """``os.open`` for a file staging keeps inside the destination, never writing through a planted link.

    Anyone who can write into the destination could leave a symlink (or a hard link) at one of
    staging's names pointing at a file elsewhere: O_NOFOLLOW refuses a symlink, O_EXCL (when the
    caller creates a new file) refuses any existing name, and a file that is not a plain file with
    one name is refused too. The refusal names the path; nothing outside the destination is touched.
    O_NONBLOCK: a FIFO planted there cannot hang the open (regular files ignore the flag).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EEXIST):
            raise
        what = "a symbolic link" if os.path.islink(path) else "already there"
        raise DestinationError(f"refusing to write {path!r}: staging's own file there is {what}; "
                               f"remove it and rerun") from e
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        raise DestinationError(f"refusing to write {path!r}: staging's own file there is not a plain file "
                               f"with one name (a directory, device or hard link); remove it and rerun")
    return fd


def _read_own(path: str) -> bytes:
    with os.fdopen(open_own(path, os.O_RDONLY), "rb") as f:
        return f.read()


def load(dest: str) -> dict[str, Entry]:
    """Entries of the last complete manifest plus any journal a killed stage left behind."""
    try:
        entries = parse(_read_own(os.path.join(dest, MANIFEST_NAME)))
    except FileNotFoundError:
        entries = {}
    try:
        journal = _read_own(os.path.join(dest, JOURNAL_NAME))
    except FileNotFoundError:
        return entries
    for line in journal.splitlines():
        try:
            item = json.loads(line)
            rel = item.pop("rel")
            entries[rel] = Entry(**item)
        except (ValueError, TypeError, KeyError, AttributeError):
            continue  # a line torn by a kill
    return entries


class Journal:
    """Append-only record of files renamed into place during this stage."""

    def __init__(self, dest: str):
        self.path = os.path.join(dest, JOURNAL_NAME)
        self._fd = open_own(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def append(self, rel: str, entry: Entry) -> None:
        # One write() per line: O_APPEND keeps lines whole between threads.
        os.write(self._fd, (json.dumps({"rel": rel, **asdict(entry)}) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def remove(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def parse(data: bytes) -> dict[str, Entry]:
    """The entries of a manifest's bytes; none for an unreadable manifest or another format
    (trust nothing: everything is verified by refetching)."""
    try:
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            return {}
        return {rel: Entry(**item) for rel, item in doc.get("files", {}).items()}
    except (ValueError, TypeError, AttributeError):
        return {}


def render(source: str, entries: dict[str, Entry]) -> bytes:
    """The complete manifest for ``entries`` staged from ``source``, as bytes."""
    doc: dict[str, Any] = {
        "format": FORMAT,
        "source": source,
        "complete": True,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "file_count": len(entries),
        "total_bytes": sum(e.size for e in entries.values()),
        "files": {rel: asdict(entries[rel]) for rel in sorted(entries)},
    }
    return json.dumps(doc, indent=1).encode()


def write(dest: str, source: str, entries: dict[str, Entry]) -> str:
    """Write the complete manifest atomically into a POSIX directory; returns its path."""
    path = os.path.join(dest, MANIFEST_NAME)
    # staging's own temp name (a stage sweeps leftovers) and refusal of a planted link (open_own)
    atomic_write_bytes(path, render(source, entries), temp=temp_name(), opener=open_own)
    return path
