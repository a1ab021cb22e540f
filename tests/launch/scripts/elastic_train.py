"""A DDP-shaped job for the elastic tests: a gloo all-reduce every step (a lost peer makes the others
fail or hang in it, as in real training), a checkpoint every few steps, and a stop on demand.

    elastic_train.py OUT_DIR --until-file FILE [--step-sleep S] [--checkpoint-every N]

Each step all-reduces a flag saying whether FILE exists, so every rank stops after the same step;
then every rank writes ``OUT_DIR/rank<R>.json`` (rank, world size, the step it resumed from and
the step it ended at). Checkpoints go through dtrain.training.checkpoint (rank 0), so a restart at
another world size resumes from the latest one.
"""

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--until-file", required=True)
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from dtrain.training.checkpoint import CheckpointManager
    from dtrain.training.watchdog import heartbeat

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = CheckpointManager(every_n_steps=args.checkpoint_every, rank=rank)
    state = ckpt.load_latest()
    step = resumed = state["step"] if state else 0
    ckpt.last_saved_step = step
    print(f"rank {rank}/{world}: from step {step}", flush=True)
    while True:
        stop = torch.tensor([1.0 if os.path.exists(args.until_file) else 0.0])
        dist.all_reduce(stop)
        if stop.item() > 0:
            break
        step += 1
        heartbeat()  # progress for the launcher's hang watch (hang_timeout)
        if ckpt.should_save(step):
            ckpt.save(step, {"world_size": world})
        time.sleep(args.step_sleep)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump({"rank": rank, "world_size": world, "resumed_from": resumed, "step": step}, fh)
    os.replace(path + ".tmp", path)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from dtrain.training.dist import exit_now

    exit_now(main())  # as the reference script: with gloo, the interpreter's teardown can abort a finished rank
