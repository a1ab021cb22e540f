"""What every benchmark here shares: timing one command the same way for each tool."""

from __future__ import annotations

import subprocess
import time


def timed(argv: list[str], env: dict[str, str]) -> float:
    """Wall seconds of ``argv`` run to completion (output discarded); exits if it fails, so no
    tool is ever timed on a run that did not do the work."""
    started = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return elapsed
