"""What every benchmark here shares: timing one command the same way for each tool."""

from __future__ import annotations

import resource
import subprocess
import time


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_cpu(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of ``argv`` run to completion (output discarded). CPU is user +
    system of its whole process tree: every descendant waited for by its parent counts in the
    command's own accounting. Exits if it fails, so no tool is ever timed on a run that did not do
    the work."""
    cpu = _children_cpu()
    started = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - started
    cpu = _children_cpu() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return elapsed, cpu


def timed(argv: list[str], env: dict[str, str]) -> float:
    """Wall seconds of ``argv`` run to completion (:func:`timed_cpu`)."""
    return timed_cpu(argv, env)[0]
