"""The torchrun agent's private log directory, for its workers' error files.

``<tmp>/dtrain-agent-<pid namespace>-<pid>-<random>``: the agent removes it when it ends; one whose
agent was killed (SIGKILL, the out-of-memory killer, a crashed host back with its /tmp) is removed
by the next agent that starts on the host, which :func:`sweep` lets go only of directories whose
agent is gone: same pid namespace (a pid means nothing across namespaces sharing a /tmp), that pid
not running, a real directory of ours (never a link, never another user's). A pid reused by a
live process keeps its directory until a later sweep. Stdlib only.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile

PREFIX = "dtrain-agent-"
NAME = re.compile(r"dtrain-agent-(\d+)-(\d+)-[A-Za-z0-9_]+\Z")


def pid_namespace() -> str | None:
    """This process's pid namespace (the inode of /proc/self/ns/pid); None where it cannot be told."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def make(base: str | None = None) -> str:
    """A new private log directory for this agent, in ``base`` (the temp folder by default)."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{pid_namespace() or 0}-{os.getpid()}-", dir=base)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        return True
    return True


def sweep(base: str | None = None) -> int:
    """Remove the log directories of this host's agents that are gone; how many went."""
    namespace = pid_namespace()
    if namespace is None:
        return 0
    base = base or tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    removed = 0
    for name in names:
        match = NAME.match(name)
        if match is None or match.group(1) != namespace or _running(int(match.group(2))):
            continue
        path = os.path.join(base, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)  # follows no link inside it either
            removed += 1
    return removed
