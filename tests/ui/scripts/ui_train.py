"""A small real DDP job (gloo) for the Training tab's tests: per-rank metrics, checkpoints, a line per step.

    ui_train.py [--steps N] [--sleep S] [--slow-data-rank R] [--fail-rank R --fail-step K]
                [--hang-rank R --hang-step K]

Every rank trains a linear model on random data with DDP and logs each step through
dtrain.training.MetricsWriter; rank 0 checkpoints every 5 steps. ``--slow-data-rank``: that
rank waits ``4 x sleep`` for each batch and skips the pause after the step, so its data-wait fraction
(which trips CPUBottleneck) stays above 0.5 on a loaded host too, in the same time per step.
``--fail-rank/--fail-step``: that rank prints a traceback-like line and exits 3 at that step.
``--hang-rank/--hang-step``: that rank stops without a word; its peers block in the all-reduce.
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--slow-data-rank", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=0)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=0)
    args = p.parse_args()
    import torch

    from dtrain.training import CheckpointManager, MetricsWriter, init_distributed

    ctx = init_distributed(timeout_s=3600)
    torch.manual_seed(ctx.rank)
    model = torch.nn.Linear(8, 1)
    if ctx.world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    metrics = MetricsWriter(ctx.rank)
    checkpoints = CheckpointManager(every_n_steps=5, keep=3, rank=ctx.rank)
    target = torch.randn(8, 1)
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        slow_data = ctx.rank == args.slow_data_rank
        time.sleep(args.sleep * (4 if slow_data else 0.2))  # "loading" the batch
        x = torch.randn(32, 8)
        y = x @ target
        waited = time.perf_counter() - started
        if ctx.rank == args.hang_rank and step == args.hang_step:
            while True:
                time.sleep(1)
        if ctx.rank == args.fail_rank and step == args.fail_step:
            print(f"step {step}: RuntimeError: rank {ctx.rank} hit a bad batch", file=sys.stderr, flush=True)
            return 3
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(0 if slow_data else args.sleep)
        metrics.log(step=step, loss=loss.item(), samples=32, step_time_s=time.perf_counter() - started,
                    data_wait_s=waited, epoch=0)
        print(f"step {step} loss {loss.item():.4f}", flush=True)
        if checkpoints.should_save(step):
            checkpoints.save(step, {"model": model.state_dict(), "step": step})
    metrics.close()
    return 0


if __name__ == "__main__":
    from dtrain.training.dist import exit_now

    # As the reference script does (dtrain.training.dist.exit_now): without it the failing rank
    # tears its interpreter down with the process group alive, slowly enough that the launcher
    # can SIGTERM it after its peer aborted, and the stopped rank cannot be named as the cause.
    exit_now(main())
