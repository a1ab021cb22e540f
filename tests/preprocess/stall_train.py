"""Launched on every rank: train a small MLP from shards with a deliberately slow loader or a slow rank.

    --load-sleep S   every batch fetch sleeps S seconds (CPU-bound input pipeline -> CPUBottleneck)
    --slow-rank R --rank-sleep S   rank R sleeps S seconds per step (a straggler -> LoadBalancing)

Ranks do not allreduce every step (each trains its own replica, a barrier at the end), so a
straggler's time stays in its own step time, as in an unsynchronised or local-SGD job.
Writes per-rank metrics through the training helper's MetricsWriter.
"""

from __future__ import annotations

import argparse
import sys
import time


class SlowFetch:
    """Wraps a dataset; each batch fetch sleeps first (a stand-in for on-the-fly decoding)."""

    def __init__(self, dataset, delay: float):
        self.dataset, self.delay = dataset, delay

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, indices):
        time.sleep(self.delay)
        return self.dataset.__getitems__(indices)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--load-sleep", type=float, default=0.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--rank-sleep", type=float, default=0.0)
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from dtrain.training.dist import init_distributed, shutdown
    from dtrain.training.metrics import MetricsWriter
    from dtrain.training.shards import ShardDataset, ShardSampler

    ctx = init_distributed()
    dataset = ShardDataset(args.shards)
    sampler = ShardSampler(len(dataset), num_replicas=ctx.world_size, rank=ctx.rank, drop_last=True)
    source = SlowFetch(dataset, args.load_sleep) if args.load_sleep else dataset
    loader = DataLoader(source, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    metrics = MetricsWriter(ctx.rank)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        while step < args.steps:
            waited = time.perf_counter()
            try:
                x, y = next(batches)
            except StopIteration:
                break
            started = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if ctx.rank == args.slow_rank:
                time.sleep(args.rank_sleep)
            step += 1
            metrics.log(step=step, epoch=epoch, loss=loss.item(), samples=len(y),
                        step_time_s=time.perf_counter() - waited, data_wait_s=started - waited)
        epoch += 1
    metrics.close()
    if ctx.world_size > 1:
        dist.barrier()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
