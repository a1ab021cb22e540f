"""DDP training of a small causal transformer on packed token blocks; run on every rank by ``dtrain launch``.

    dtrain launch --nodes 1 --procs-per-node 2 -- python -m text_pipeline.train \
        --shards /fsx/text/2026-01-01 --output /fsx/models/candidate.pt --init-from /fsx/models/champion.pt

The shards hold ``input_ids`` blocks of a fixed length (``dtrain preprocess --pack input_ids``):
each is a training example as is, read at the shard reader's full speed with no padding. The
bookkeeping (resume from the run directory's checkpoints, warm start, SIGTERM -> checkpoint and exit
143, per-rank metrics) is dtrain's ``TrainLoop``; the model and its loss are this package's.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil

import torch
import torch.distributed as dist

from dtrain.training import PreemptionGuard, init_distributed, write_result
from dtrain.training.dist import exit_now, shutdown
from dtrain.training.loop import TrainLoop, script_args
from dtrain.training.prefetch import DevicePrefetcher
from dtrain.training.shards import ShardDataset, ShardLoader, ShardSampler

from text_pipeline import model as lm
from text_pipeline.tokenizer import PATH as TOKENIZER_PATH
from text_pipeline.tokenizer import VOCAB_SIZE

#: beside the model in the run directory: the tokenizer it was trained with, which the DAG's MLflow
#: registry logs with each version (``artifacts={"tokenizer": "tokenizer.json"}``)
TOKENIZER_FILE = "tokenizer.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return script_args(__doc__.splitlines()[0], epochs=4, lr=3e-3, batch_size=16).parse_args(argv)


def packed_blocks(shards: str, ctx, batch_size: int, seed: int) -> tuple[ShardDataset, ShardSampler, ShardLoader]:
    """The dataset of packed blocks, and this rank's share of it in batches (a new order every epoch)."""
    dataset = ShardDataset(shards, fields=("input_ids",))
    sampler = ShardSampler(len(dataset), num_replicas=ctx.world_size, rank=ctx.rank, seed=seed, drop_last=True)
    loader = ShardLoader(dataset, batch_size, sampler)
    if len(loader) == 0:
        raise SystemExit(f"{len(dataset)} blocks give rank {ctx.rank} no full batch of {batch_size}")
    return dataset, sampler, loader


def save_with_tokenizer(model: lm.CausalLM, output: str) -> None:
    """The model at ``output`` and, beside it, the tokenizer it was trained with: a model is read with
    its own tokenizer only, so they travel together (each written whole: a reader never sees half)."""
    lm.save(model, output)
    folder = os.path.dirname(os.path.abspath(output))
    tmp = os.path.join(folder, f".{TOKENIZER_FILE}.{os.getpid()}.tmp")
    shutil.copyfile(TOKENIZER_PATH, tmp)
    os.replace(tmp, os.path.join(folder, TOKENIZER_FILE))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = init_distributed()
    guard = PreemptionGuard()  # from here a SIGTERM means: checkpoint, then exit
    dataset, sampler, loader = packed_blocks(args.shards, ctx, args.batch_size, args.seed)
    block_size = dataset.specs["input_ids"]["shape"][0]

    device = torch.device(ctx.device)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = lm.CausalLM(VOCAB_SIZE, block_size).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loop = TrainLoop(model, optimizer, rank=ctx.rank, checkpoint_every=args.checkpoint_every, guard=guard)
    loop.restore(args.init_from, lambda path: model.load_state_dict(lm.load(path, device).state_dict()))
    train_model = torch.nn.parallel.DistributedDataParallel(model) if ctx.world_size > 1 else model
    loop.time_collectives(train_model)  # each step's all-reduce wait: the stall report names a straggler

    def train_step(batch: tuple[torch.Tensor]) -> tuple[torch.Tensor, int]:
        loss = lm.next_token_loss(train_model, batch[0].to(device, non_blocking=True))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach(), len(batch[0])  # a tensor: TrainLoop reads it later, the step never waits

    # A thread reads the next blocks (and on a GPU copies them through pinned memory on a side stream):
    # the training thread never waits for the loader's work.
    batches = DevicePrefetcher(loader, device)
    step = loop.run(batches, sampler, args.epochs, train_step)  # on SIGTERM: checkpoint, then exit 143

    if ctx.world_size > 1:
        dist.barrier()  # every rank has finished its last step before rank 0 publishes the model
    if ctx.is_main:
        save_with_tokenizer(model, args.output)
        last = loop.last_loss if math.isfinite(loop.last_loss) else None  # None: resumed at the end, no step run
        result = {"final_loss": last and round(last, 4), "train_perplexity": last and round(math.exp(last), 3),
                  "steps": step, "epochs": args.epochs, "blocks": len(dataset), "block_size": block_size,
                  "world_size": ctx.world_size, "warm_start_from": loop.warm_start,
                  "resumed_from_step": loop.resumed_from, "model_path": args.output}
        write_result(result)
        print(f"train: {result}")
    shutdown()
    return 0


if __name__ == "__main__":
    exit_now(main())  # skips the interpreter teardown in which gloo can abort a finished rank
