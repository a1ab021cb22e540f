"""Wall and CPU time of `dtrain launch` against bare `torchrun` for the same 1 node x 2 process job.

Runs the two alternately (so load drifts hit both alike) and prints one line with the median of
each and their ratio, for wall time and for CPU time (user + system of the whole process tree: the
launcher, the agent, the rank wrappers and the ranks). The ratio is the median of each pair's own
ratio: a pair ran back to back, so a slow spell of the machine moves both of its figures, not one
median. Goal: both ratios <= 1.05.

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


def tool_commands(job: str) -> dict[str, list[str]]:
    """The same 1 node x 2 process job of script ``job`` under each tool."""
    return {
        "dtrain": [os.path.join(BIN, "dtrain"), "launch", "--nodes", "1", "--procs-per-node", "2", "--", job],
        "torchrun": [os.path.join(BIN, "torchrun"), "--standalone", "--nnodes", "1", "--nproc-per-node", "2", job],
    }


def run_pairs(runs: int, env: dict[str, str]) -> None:
    commands = tool_commands(JOB)
    for argv in commands.values():
        timed_cpu(argv, env)  # warm the page cache for both
    wall: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            w, c = timed_cpu(argv, env)
            wall[name].append(w)
            cpu[name].append(c)

    print(f"launch 1x2 gloo job: {figures('wall', wall)}; {figures('cpu', cpu)} "
          f"(medians of {runs} pairs, alternating; ratio: the median pair's; goal <= {GOAL:.2f})")


def figures(kind: str, times: dict[str, list[float]]) -> str:
    """``times``: each tool's figures, pair by pair (the i-th of each ran back to back)."""
    d, t = statistics.median(times["dtrain"]), statistics.median(times["torchrun"])
    ratio = statistics.median(a / b for a, b in zip(times["dtrain"], times["torchrun"], strict=True))
    return f"{kind} dtrain {d:.2f} s, torchrun {t:.2f} s, ratio {ratio:.2f}"


if __name__ == "__main__":
    main()
