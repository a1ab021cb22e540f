"""Run ``dtrain ARGS...`` in this process, then print its peak resident memory as the last line:
``PEAK_RSS_KIB <n>``. Run it with ``--workers 1``, so that all the work is in this one process.

The peak is VmHWM from /proc/self/status: the high-water mark of this process's own memory
since it started. Not getrusage's ru_maxrss: Linux carries that across fork + exec, so a process
started by pytest reports pytest's own peak (about the same number for every run measured).
"""

from __future__ import annotations

import sys

from dtrain.cli import main


def peak_rss_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    print(f"PEAK_RSS_KIB {peak_rss_kib()}", flush=True)
    sys.exit(rc)
