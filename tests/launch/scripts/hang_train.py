"""A DDP-style loop in which one rank goes silent at a chosen step while its peers block in all_reduce.

    hang_train.py --silent-rank 1 --silent-step 5 [--no-helper]

Every rank prints a line and all-reduces a tensor each step. At ``--silent-step`` the silent
rank records when it went quiet (``<run_dir>/went_silent``) and sleeps without a word; the
others enter the step's all_reduce and wait for it forever (a collective timeout of an hour).
``--no-helper`` joins the process group with torch directly, not through dtrain's
init_distributed, as a script that ignores the training helper would.

``--quiet-step N --quiet-seconds S [--heartbeat]``: at step N every rank works for S seconds
without printing (a long evaluation), calling dtrain's ``heartbeat()`` twice a second when
asked; with ``--steps`` the script then ends normally.

``--start-seconds S``: every rank says nothing for S seconds before it imports torch (a slow start-up).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta


def go_silent(run_dir: str) -> None:
    with open(os.path.join(run_dir, "went_silent"), "w", encoding="utf-8") as fh:
        fh.write(f"{time.time()}\n")
    while True:
        time.sleep(1)


def quiet_work(seconds: float, beat: bool) -> None:
    from dtrain.training import heartbeat

    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if beat:
            heartbeat()
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--silent-rank", type=int, default=1)
    p.add_argument("--silent-step", type=int, default=5, help="0: no rank goes silent")
    p.add_argument("--no-helper", action="store_true")
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--quiet-step", type=int, default=0)
    p.add_argument("--quiet-seconds", type=float, default=0.0)
    p.add_argument("--heartbeat", action="store_true")
    p.add_argument("--start-seconds", type=float, default=0.0)
    args = p.parse_args()
    time.sleep(args.start_seconds)
    import torch
    import torch.distributed as dist

    if args.no_helper:
        dist.init_process_group("gloo", timeout=timedelta(hours=1))
    else:
        from dtrain.training import init_distributed

        init_distributed(timeout_s=3600)
    rank = dist.get_rank()
    tensor = torch.ones(4)
    for step in range(1, args.steps + 1):
        if step == args.silent_step and rank == args.silent_rank:
            go_silent(os.environ["DTRAIN_RUN_DIR"])
        if step == args.quiet_step:
            quiet_work(args.quiet_seconds, args.heartbeat)
        print(f"step {step}", flush=True)
        dist.all_reduce(tensor)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
