"""A job's secret on a node: how it arrives there, and the one HMAC that everything it keys computes.

The launcher hands a node-side process (the detached SSH daemon, Slurm's lease holder, an elastic
agent, the rendezvous store) a secret on its stdin, never in an argv, an environment, a file or a
log. :func:`read_stdin_line` takes that one line and then points stdin at /dev/null, so that no
process started later (the ranks) can read anything there.

Every MAC the job computes, over a record, a store value or a round line, is :func:`mac`
(HMAC-SHA256, hex), and every check is :func:`mac_matches` (``hmac.compare_digest``). Stdlib only.
"""

from __future__ import annotations

import hashlib
import hmac
import os

#: the most a secret line on stdin can be (a JSON object of a few short strings)
SECRET_LINE_LIMIT = 4096


def read_stdin_line(fd: int = 0, limit: int = SECRET_LINE_LIMIT, close: bool = True) -> bytes:
    """One line from ``fd`` (its newline kept; at most ``limit`` + 1 bytes, end of input ends it early), read
    byte by byte so that nothing past it is taken from a shared stdin; then ``fd`` points at /dev/null
    (``close``), so that no child reads anything there."""
    data = b""
    try:
        while not data.endswith(b"\n") and len(data) <= limit:
            chunk = os.read(fd, 1)
            if not chunk:
                break
            data += chunk
    finally:
        if close:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
    return data


def mac(key: bytes, message: bytes) -> str:
    """HMAC-SHA256 of ``message`` under ``key``, as 64 lowercase hex digits."""
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def mac_matches(key: bytes, message: bytes, given: str | bytes) -> bool:
    """Whether ``given`` is :func:`mac` of ``message`` under ``key`` (compared in constant time)."""
    if isinstance(given, str):
        given = given.encode("ascii", "replace")
    return hmac.compare_digest(bytes(given), mac(key, message).encode())
