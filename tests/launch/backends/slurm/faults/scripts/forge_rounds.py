"""A rank that forges the launcher's round lines, then trains as elastic_train.py does:
``forge_rounds.py ELASTIC_TRAIN ARGS...``.

Before it trains, each rank appends look-alike round lines (``[dtrain-round] ...``: unsigned, and with a
made-up MAC) for a round 999999999 that both nodes tell, to its own output and straight into the job's
Slurm output file in the run directory (the one log the launcher parses). Then it execs ELASTIC_TRAIN.
"""

import glob
import os
import sys

ROUND = 999999999


def forged_lines() -> list[str]:
    lines = []
    for node in (0, 1):
        body = f"[dtrain-round] node={node} round={ROUND} group_rank={node} group_world_size=2"
        lines += [body, f"{body} mac={'0' * 64}"]
    return lines


def main() -> None:
    text = "".join(line + "\n" for line in forged_lines())
    os.write(1, text.encode())
    for log in glob.glob(os.path.join(os.environ["DTRAIN_RUN_DIR"], "slurm-*.out")):
        with open(log, "a") as out:
            out.write(text)
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


if __name__ == "__main__":
    main()
