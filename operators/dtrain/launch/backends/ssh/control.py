"""OpenSSH connection reuse (ControlMaster) for the repeated ssh calls of a deferred job.

The trigger asks hosts over ssh again and again (status of a host whose shared-filesystem
heartbeat is stale, then stop); without reuse each call is a full handshake: key exchange,
authentication, a new sshd session. With ``ControlMaster=auto`` the first call to a host
leaves a master connection behind (``ControlPersist``) and later calls ride it as multiplexed
sessions.

The sockets live in a per-job directory inside a per-user one, both created here with mode
0700 and checked with ``lstat`` (a directory we own, not a symlink, nobody else's bits),
because a socket in a directory another user can write lets that user run commands on our
hosts as us. Socket names are ``n<node index>``: short (a unix socket path has at most 107
bytes) and known to us, so :func:`close_argvs` finds exactly the masters to close.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile

from dtrain.errors import LaunchError

#: seconds an idle master stays up: longer than the trigger's longest poll interval, so polls reuse it
DEFAULT_PERSIST = 120


def _private_dir(path: str) -> str:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise LaunchError(f"refusing to keep ssh control sockets in {path}: it must be a directory of ours "
                          f"(not a symlink) with mode 0700, found mode {stat.filemode(info.st_mode)} "
                          f"owner uid {info.st_uid}", 2)
    return path


def control_dir(job_key: str, base: str | None = None, create: bool = True) -> str:
    """The job's private socket directory: ``<tmp>/dtrain-ssh-<uid>/<hash of job_key>``, created
    (and checked) now, or with ``create=False`` by :func:`ensure` when a first ssh call needs it."""
    path = os.path.join(base or tempfile.gettempdir(), f"dtrain-ssh-{os.getuid()}",
                        hashlib.sha256(job_key.encode()).hexdigest()[:12])
    return ensure(path) if create else path


def ensure(directory: str) -> str:
    """Create (or check) the socket directory and its per-user parent: ours, mode 0700, no symlink."""
    _private_dir(os.path.dirname(directory))
    return _private_dir(directory)


def socket_path(directory: str, node: int) -> str:
    return os.path.join(directory, f"n{node}")


def mux_options(path: str, persist: int = DEFAULT_PERSIST) -> list[str]:
    return ["-o", "ControlMaster=auto", "-o", f"ControlPath={path}", "-o", f"ControlPersist={int(persist)}"]


def live_sockets(directory: str) -> list[int]:
    """Node indexes whose master socket exists (a master that is up, or one that just died)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(int(name[1:]) for name in names
                  if name.startswith("n") and name[1:].isdigit()
                  and stat.S_ISSOCK(os.lstat(os.path.join(directory, name)).st_mode))


async def wait_closed(directory: str, timeout: float = 3.0) -> None:
    """Wait (at most ``timeout`` s) until no master socket is left: ``ssh -O exit`` returns when the
    master has been asked to end, and the master removes its socket a moment later."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while live_sockets(directory) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def remove_dir(directory: str) -> None:
    """Drop the job's socket directory once its masters are closed (left as is if not empty)."""
    try:
        os.rmdir(directory)
    except OSError:
        pass
