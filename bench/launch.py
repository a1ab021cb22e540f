"""Wall time of `dtrain launch` against bare `torchrun` for the same 1 node x 2 process job.

Runs the two alternately (so load drifts hit both alike), takes the median of each,
and prints one line with both times and the ratio. Goal: ratio <= 1.10.

    .venv/bin/python bench/launch.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
JOB = os.path.join(HERE, "scripts", "allreduce.py")


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", DTRAIN_HOME=tempfile.mkdtemp(prefix="bench-launch-"))
    dtrain = [os.path.join(BIN, "dtrain"), "launch", "--nodes", "1", "--procs-per-node", "2", "--", JOB]
    torchrun = [os.path.join(BIN, "torchrun"), "--standalone", "--nnodes", "1", "--nproc-per-node", "2", JOB]
    timed(dtrain, env), timed(torchrun, env)  # warm the page cache for both
    times: dict[str, list[float]] = {"dtrain": [], "torchrun": []}
    for _ in range(args.runs):
        times["dtrain"].append(timed(dtrain, env))
        times["torchrun"].append(timed(torchrun, env))
    d, t = statistics.median(times["dtrain"]), statistics.median(times["torchrun"])
    print(f"launch 1x2 gloo job: dtrain launch {d:.3f} s, bare torchrun {t:.3f} s, ratio {d / t:.3f} "
          f"(median of {args.runs}, alternating; goal <= 1.10)")


if __name__ == "__main__":
    main()
