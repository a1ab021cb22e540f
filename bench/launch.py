"""Wall time of `dtrain launch` against bare `torchrun` for the same 1 node x 2 process job.

Runs the two alternately (so load drifts hit both alike), takes the median of each,
and prints one line with both times and the ratio. Goal: ratio <= 1.10.

    .venv/bin/python bench/launch.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from timing import timed  # bench/ is on sys.path when a benchmark runs as a script

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
JOB = os.path.join(HERE, "scripts", "allreduce.py")


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
