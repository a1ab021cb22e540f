"""A training job that leaves evidence of how many times it ran, for the re-attach and retry tests.

    resumable_train.py OUT_DIR [--sleep S] [--until-file FILE] [--fail-once TEXT]

Every rank appends one line to ``OUT_DIR/starts.jsonl`` as it starts (its rank, pid, dtrain job
id, Slurm job id): a job that ran twice leaves twice as many lines. ``--fail-once TEXT``: rank 0
of the first run prints TEXT and exits 1 (later runs find ``OUT_DIR/failed-once`` and carry on).
``--sleep S``: train for S seconds (a line every second: the job is alive). ``--until-file FILE``:
stop training as soon as FILE exists, S being only the most it trains (a test releases the job
once it has seen what had to happen while the job ran, instead of sleeping a worst-case time).
Then, with more than one rank, a real gloo all-reduce of ``rank + 1`` over every rank, and
``OUT_DIR/rank<R>.json``.
"""

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--until-file", default="")
    parser.add_argument("--fail-once", default="")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ids = {"job": os.environ.get("DTRAIN_JOB_ID"), "slurm_job": os.environ.get("SLURM_JOB_ID")}
    os.makedirs(args.out_dir, exist_ok=True)
    line = json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time(), **ids}) + "\n"
    fd = os.open(os.path.join(args.out_dir, "starts.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one small O_APPEND write: lines of concurrent ranks never mix
    finally:
        os.close(fd)
    if args.fail_once and rank == 0:
        try:
            os.close(os.open(os.path.join(args.out_dir, "failed-once"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            print(args.fail_once, file=sys.stderr, flush=True)
            return 1
    deadline = time.monotonic() + args.sleep
    step = 0
    while time.monotonic() < deadline and not (args.until_file and os.path.exists(args.until_file)):
        step += 1
        print(f"rank {rank}: step {step}", flush=True)
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    total = rank + 1
    if world > 1:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        tensor = torch.tensor([float(rank + 1)])
        dist.all_reduce(tensor)
        total = int(tensor.item())
        dist.destroy_process_group()
    path = os.path.join(args.out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump({"rank": rank, "world_size": world, "sum": total, **ids}, fh)
    os.replace(path + ".tmp", path)
    print(f"rank {rank}: done, all-reduced sum {total}", flush=True)
    return 0


if __name__ == "__main__":
    from dtrain.training.dist import exit_now

    exit_now(main())  # as the reference script: with gloo, the interpreter's teardown can abort a finished rank
