"""Wall and CPU time of `dtrain launch` against bare `torchrun` for the same 1 node x 2 process job.

Runs the two alternately (so load drifts hit both alike), takes the median of each, and prints
one line with both figures and their ratio, for wall time and for CPU time (user + system of the
whole process tree: the launcher, the agent, the rank wrappers and the ranks). Goal: both ratios
<= 1.05.

    .venv/bin/python bench/launch.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from timing import timed_cpu  # bench/ is on sys.path when a benchmark runs as a script

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
JOB = os.path.join(HERE, "scripts", "allreduce.py")
GOAL = 1.05


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as home:  # the jobs' run directories
        run_pairs(args.runs, dict(os.environ, OMP_NUM_THREADS="1", DTRAIN_HOME=home))


def run_pairs(runs: int, env: dict[str, str]) -> None:
    commands = {
        "dtrain": [os.path.join(BIN, "dtrain"), "launch", "--nodes", "1", "--procs-per-node", "2", "--", JOB],
        "torchrun": [os.path.join(BIN, "torchrun"), "--standalone", "--nnodes", "1", "--nproc-per-node", "2", JOB],
    }
    for argv in commands.values():
        timed_cpu(argv, env)  # warm the page cache for both
    wall: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            w, c = timed_cpu(argv, env)
            wall[name].append(w)
            cpu[name].append(c)

    def figures(kind: str, times: dict[str, list[float]]) -> str:
        d, t = statistics.median(times["dtrain"]), statistics.median(times["torchrun"])
        return f"{kind} dtrain {d:.2f} s, torchrun {t:.2f} s, ratio {d / t:.2f}"

    print(f"launch 1x2 gloo job: {figures('wall', wall)}; {figures('cpu', cpu)} "
          f"(median of {runs} pairs, alternating; goal <= {GOAL:.2f})")


if __name__ == "__main__":
    main()
