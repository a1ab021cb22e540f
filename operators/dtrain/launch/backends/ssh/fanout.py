"""Run one ssh command per host with at most ``limit`` running at once (pdsh's ``-f``).

Starting 500 ssh clients at once means 500 simultaneous handshakes: sshd's MaxStartups
(10:30:100 by default) drops connections beyond 10 unauthenticated ones at random, and the
launching host runs 500 processes. Every SSH action of the backend (start, poll, stop,
signals, preflight) goes through here, bounded by the ``fanout`` setting (default 32, as
pdsh's). Results come back in host order; a command that did not run (``stop_on_failure``
after a failure elsewhere) reports :data:`NOT_RUN`.
"""

from __future__ import annotations

import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

DEFAULT_FANOUT = 32
MAX_FANOUT = 1024  # DeepSpeed's pdsh runner uses -f 1024
NOT_RUN = (None, "", "not started: an earlier host failed")

Result = tuple  # (returncode | None, stdout, stderr)


def run_bounded(argvs: Sequence[Sequence[str]], *, limit: int, timeout: float,
                stdin: Sequence[bytes | None] | None = None, stop_on_failure: bool = False) -> list[Result]:
    """Run every argv, at most ``limit`` at once; ``(returncode, stdout, stderr)`` per argv, in order.

    ``stdin[i]`` is what command i reads (None: nothing, never this process's stdin). A timeout
    reads as ssh's own failure code (255). With ``stop_on_failure``, commands not yet started
    when one fails are skipped (their result is :data:`NOT_RUN`).
    """
    results: list[Result] = [NOT_RUN] * len(argvs)
    failed = threading.Event()

    def one(i: int) -> None:
        if stop_on_failure and failed.is_set():
            return
        data = None if stdin is None else stdin[i]
        try:
            done = subprocess.run(list(argvs[i]), input=data, stdin=subprocess.DEVNULL if data is None else None,
                                  capture_output=True, timeout=timeout)
            results[i] = (done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))
        except subprocess.TimeoutExpired:
            results[i] = (255, "", f"timed out after {timeout:.0f}s")
        except OSError as e:
            results[i] = (255, "", f"could not run {argvs[i][0]}: {e}")
        if results[i][0] != 0:
            failed.set()

    if argvs:
        with ThreadPoolExecutor(max_workers=max(1, min(limit, len(argvs))), thread_name_prefix="dtrain-ssh") as pool:
            list(pool.map(one, range(len(argvs))))
    return results


async def run_bounded_async(argvs: Sequence[Sequence[str]], *, limit: int, timeout: float,
                            stdin: Sequence[bytes | None] | None = None) -> list[Result]:
    """:func:`run_bounded` for the triggerer's event loop (no thread per host)."""
    import asyncio  # loaded by the running loop already; a launcher never imports it

    from dtrain.launch.backends.base import run_async

    gate = asyncio.Semaphore(max(1, limit))

    async def one(argv: Sequence[str], data: bytes | None) -> Result:
        async with gate:
            try:
                return await run_async(argv, timeout, data)
            except TimeoutError:
                return 255, "", f"timed out after {timeout:.0f}s"

    return list(await asyncio.gather(*(one(argv, None if stdin is None else stdin[i])
                                       for i, argv in enumerate(argvs))))
