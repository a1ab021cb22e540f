"""DDP training of a small MLP regressor on preprocessed tabular shards; run on every rank by ``dtrain launch``.

    dtrain launch --nodes 1 --procs-per-node 2 -- python -m tabular_pipeline.train \
        --shards /fsx/tabular/2026-01-01 --output /fsx/models/candidate.pt --init-from /fsx/models/champion.pt

Rank, world size and master address come from the torchrun env contract (``init_distributed``);
checkpoints and metrics go to the launcher's run directory, so a relaunch with the same run
directory resumes from the latest checkpoint. On SIGTERM every rank stops after the same step,
a checkpoint for that step is saved and the process exits with the guard's code (143): the
bookkeeping is dtrain's ``TrainLoop``; the model, the loss and the result are this script's.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from dtrain.training import PreemptionGuard, init_distributed, write_result
from dtrain.training.dist import exit_now, shutdown
from dtrain.training.loop import TrainLoop, script_args
from dtrain.training.prefetch import DevicePrefetcher
from dtrain.training.shards import ShardDataset, ShardLoader, ShardSampler

from tabular_pipeline.data import FEATURES

HIDDEN = 32


def build_model() -> torch.nn.Module:
    """The regressor: FEATURES -> 32 -> 1. evaluate.py builds the same one to load the weights."""
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return script_args(__doc__.splitlines()[0], epochs=5, lr=0.05, batch_size=64).parse_args(argv)


def atomic_save(obj: object, path: str) -> None:
    """torch.save to a temp file beside ``path``, then rename: a reader never sees half a model."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def dataset_rmse(model: torch.nn.Module, dataset: ShardDataset, device: torch.device, chunk: int = 65536) -> float:
    """RMSE over every training sample, read in chunks so a large dataset is never all in memory."""
    model.eval()
    squared, n = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(dataset), chunk):
            x, y = dataset.get_batch(range(start, min(start + chunk, len(dataset))))
            err = model(x.to(device)).squeeze(1) - y.to(device)
            squared += float((err.double() ** 2).sum())
            n += len(y)
    model.train()
    return (squared / max(n, 1)) ** 0.5


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    ctx = init_distributed()
    guard = PreemptionGuard()  # from here a SIGTERM means: checkpoint, then exit
    device = torch.device(ctx.device)

    dataset = ShardDataset(args.shards, fields=("x", "y"))
    # Epoch-seeded and split by rank, equal counts per rank: the same order again on a resume.
    sampler = ShardSampler(len(dataset), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                           seed=args.seed, drop_last=True)
    loader = ShardLoader(dataset, args.batch_size, sampler)
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise SystemExit(f"{len(dataset)} samples give rank {ctx.rank} no full batch of {args.batch_size}")

    model = build_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loop = TrainLoop(model, optimizer, rank=ctx.rank, checkpoint_every=args.checkpoint_every, guard=guard)
    loop.restore(args.init_from, lambda path: model.load_state_dict(torch.load(path, map_location=device,
                                                                               weights_only=True)))
    train_model = torch.nn.parallel.DistributedDataParallel(model) if ctx.world_size > 1 else model
    loop.time_collectives(train_model)  # each step's all-reduce wait: the stall report names a straggler
    loss_fn = torch.nn.MSELoss()

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = (t.to(device, non_blocking=True) for t in batch)
        loss = loss_fn(train_model(x).squeeze(1), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach(), len(y)  # a tensor: TrainLoop reads it later, the step never waits

    # A thread reads the next blocks (and on a GPU copies them through pinned memory on a side stream):
    # the training thread never waits for the loader's work.
    batches = DevicePrefetcher(loader, device)
    step = loop.run(batches, sampler, args.epochs, train_step)  # on SIGTERM: checkpoint, then exit 143

    if ctx.world_size > 1:
        dist.barrier()  # every rank has finished its last step before rank 0 publishes the model
    if ctx.is_main:
        train_rmse = dataset_rmse(model, dataset, device)
        atomic_save(model.state_dict(), args.output)
        write_result({
            "train_rmse": round(train_rmse, 6), "steps": step, "epochs": args.epochs,
            "world_size": ctx.world_size, "warm_start_from": loop.warm_start, "resumed_from_step": loop.resumed_from,
            "model_path": args.output,
        })
        print(f"train: epochs={args.epochs} steps={step} world_size={ctx.world_size} train_rmse={train_rmse:.4f}")
    shutdown()
    return 0


if __name__ == "__main__":
    exit_now(main())  # skips the interpreter teardown in which gloo can abort a finished rank
