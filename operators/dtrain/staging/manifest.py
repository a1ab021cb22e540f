"""The destination's manifest: what was staged, written last and atomically.

``.dtrain-manifest.json`` says the directory is complete and what each file is
(relative path, size, ETag or change token, version id, checksum). While a stage
runs, each file renamed into place is appended to ``.dtrain-manifest.journal``, so
a stage killed with SIGKILL resumes without refetching what already landed. The
journal is folded into the manifest and removed at the end.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

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


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a hidden temp file in the same directory, fsync, rename."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{os.path.basename(path)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def load(dest: str) -> dict[str, Entry]:
    """Entries of the last complete manifest plus any journal a killed stage left behind."""
    try:
        with open(os.path.join(dest, MANIFEST_NAME), "rb") as f:
            entries = parse(f.read())
    except FileNotFoundError:
        entries = {}
    try:
        with open(os.path.join(dest, JOURNAL_NAME), "rb") as f:
            for line in f:
                try:
                    item = json.loads(line)
                    rel = item.pop("rel")
                    entries[rel] = Entry(**item)
                except (ValueError, TypeError, KeyError):
                    continue  # a line torn by a kill
    except FileNotFoundError:
        pass
    return entries


class Journal:
    """Append-only record of files renamed into place during this stage."""

    def __init__(self, dest: str):
        self.path = os.path.join(dest, JOURNAL_NAME)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

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
    atomic_write_bytes(path, render(source, entries))
    return path
