"""A small training job for the DCP checkpoint tests: a real gloo job of WORLD_SIZE ranks.

It resumes from the latest checkpoint (if any), trains to ``--steps`` (global step), saves every
``--every`` steps and at its last step, and records for the test:

* ``<out>/ref-<step>.pt`` (rank 0): the full model and optimizer state as it was saved at <step>;
* ``<out>/loaded-<step>.pt`` (rank 0): the full state right after resuming from <step>;
* ``<out>/samples.rank<R>.jsonl``: the sample indices each step trained (with its epoch).

``--hang PHASE --hang-step S`` stops the save of step S at a phase and waits there to be killed,
after touching ``<out>/ready.<rank>``: ``write`` (rank 1 stops before writing its shards),
``commit`` (rank 0 stops after every shard and .metadata, before the commit marker), ``async``
(every rank's background upload stops; training goes on). The pause is the test's only patch: the
save, the job and the kill are real.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dtrain.training import CheckpointManager
from dtrain.training.data_position import ResumableSampler
from dtrain.training.dcp import ModelState
from dtrain.training.dist import exit_now, init_distributed

SAMPLES, FEATURES = 96, 8


def build_model(kind: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        return model, model
    if kind == "ddp" and dist.is_initialized():  # "plain": the same model, unwrapped
        return model, torch.nn.parallel.DistributedDataParallel(model)
    return model, model


def full_state(model, optimizer) -> dict:
    """Every tensor whole on rank 0 (a collective for FSDP2)."""
    m, o = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": m, "optimizer": o}


def pause_at(obj, method: str, ready: str) -> None:
    def paused(*args, **kwargs):
        open(ready, "w").close()
        time.sleep(3600)  # until the test kills the job

    setattr(obj, method, paused)


def install_pause(ckpt, phase: str, rank: int, ready: str) -> None:
    checkpointer = ckpt._dcp
    if phase == "commit" and rank == 0:
        pause_at(checkpointer, "_commit", ready)
    elif phase == "write" and rank == 1 or phase == "async":
        open_writer = checkpointer.storage.writer

        def writer(name, host_buffers=None):
            w = open_writer(name, host_buffers)
            pause_at(w, "write_data", ready)
            return w

        checkpointer.storage.writer = writer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--through-host", action="store_true",
                   help="load (and save synchronously) through the host buffers, as CUDA tensors do")
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--hang", choices=("write", "commit", "async"))
    p.add_argument("--hang-step", type=int, default=0)
    args = p.parse_args()

    if args.through_host:
        import dtrain.training.dcp as dcp_module

        dcp_module._through_host = lambda state: True
    ctx = init_distributed()
    model, wrapped = build_model(args.model)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    features = torch.randn(SAMPLES, FEATURES, generator=torch.Generator().manual_seed(1))
    sampler = ResumableSampler(DistributedSampler(range(SAMPLES), seed=3, shuffle=True))
    ckpt = CheckpointManager(args.dir, every_n_steps=args.every, keep=args.keep, rank=ctx.rank, format="dcp",
                             async_save=args.async_save)
    app = ModelState(wrapped, optimizer)

    resumed = ckpt.load_latest(into={"app": app, "data": sampler})
    step = 0 if resumed is None else resumed["step"]
    if resumed is not None:
        state = full_state(wrapped, optimizer)
        if ctx.rank == 0:
            torch.save(state, os.path.join(args.out, f"loaded-{step}.pt"))
    log = open(os.path.join(args.out, f"samples.rank{ctx.rank}.jsonl"), "a")
    epoch = sampler.epoch
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in DataLoader(range(SAMPLES), batch_size=args.batch, sampler=sampler):
            optimizer.zero_grad()
            wrapped(features[batch]).pow(2).mean().backward()
            optimizer.step()
            sampler.advance(len(batch))
            step += 1
            log.write(json.dumps({"step": step, "epoch": epoch, "indices": batch.tolist()}) + "\n")
            log.flush()
            if ckpt.should_save(step) or step == args.steps:
                if args.hang and step == args.hang_step:
                    install_pause(ckpt, args.hang, ctx.rank, os.path.join(args.out, f"ready.{ctx.rank}"))
                ckpt.save(step, {"app": app, "data": sampler})
                if not args.hang or step < args.hang_step:
                    ckpt.wait()  # the reference is of a complete checkpoint (the async one included)
                    state = full_state(wrapped, optimizer)
                    if ctx.rank == 0:
                        torch.save(state, os.path.join(args.out, f"ref-{step}.pt"))
            if step >= args.steps:
                break
        else:
            epoch += 1
    log.close()
    if args.hang:
        time.sleep(3600)  # the save in flight never ends: wait for the kill
    return 0


if __name__ == "__main__":
    exit_now(main())
