"""How long a rank's ``init_process_group`` waits for its peers once every rank has imported torch:
`dtrain launch` against bare `torchrun` for the same 1 node x 2 process gloo job.

Each run's figure is the time from the last rank's end of ``import torch`` to the last rank's return
from ``init_process_group`` (bench/scripts/join_rank.py writes both moments). Under torchrun the
ranks bootstrap from a store their agent opened before they started; a store that is not listening
yet when a rank connects costs that rank TCPStore's connect back-off. Runs the two tools
alternately and prints one line: the median of each and their ratio.

    .venv/bin/python bench/join.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from launch import HERE, tool_commands  # bench/ is on sys.path when a benchmark runs as a script
from timing import timed

JOB = os.path.join(HERE, "scripts", "join_rank.py")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-join-") as home:  # run directories and rank records
        waits = run_pairs(args.runs, home)
    d, t = statistics.median(waits["dtrain"]), statistics.median(waits["torchrun"])
    print(f"join of a 1x2 gloo job (last rank's import of torch to its process group): dtrain {d:.3f} s, "
          f"torchrun {t:.3f} s, ratio {d / t:.2f} (medians of {args.runs} runs each, alternating)")


def run_pairs(runs: int, home: str) -> dict[str, list[float]]:
    waits: dict[str, list[float]] = {name: [] for name in ("dtrain", "torchrun")}
    for index in range(runs):
        for name, argv in tool_commands(JOB).items():
            out = os.path.join(home, f"{name}-{index}")
            os.mkdir(out)
            timed(argv, dict(os.environ, OMP_NUM_THREADS="1", DTRAIN_HOME=home, JOIN_OUT=out))
            waits[name].append(join_wait(out))
    return waits


def join_wait(out: str) -> float:
    """Seconds from the last rank's import to the last rank's join, from the ranks' records in ``out``."""
    records = []
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name), encoding="utf-8") as fh:
            records.append(json.load(fh))
    if len(records) != 2:
        raise SystemExit(f"expected 2 rank records in {out}, found {len(records)}")
    return max(r["joined"] for r in records) - max(r["imported"] for r in records)


if __name__ == "__main__":
    main()
