"""One rank of bench/checkpoint.py: an FSDP2 model (about --params-gib of float32 parameters) with
Adam state, checkpointed three ways to --location; rank 0 writes the seconds to --out (JSON). Each way saves
once untimed first (process groups, thread pools, first-call costs), then once timed.

* torch.save (rank 0): every tensor gathered whole to rank 0 (what a sharded model needs to reach one
  file), one torch.save there, a barrier; the load: rank 0 reads the file and broadcasts;
* DCP synchronous and DCP asynchronous: CheckpointManager(format="dcp"), every rank its shards; the
  load: load_latest (every rank reads what its shards need).

The stall is the longest any rank spends inside the save call (training is blocked there); for the
asynchronous save, one training step then runs while the upload goes on, and the time until the
checkpoint is committed is recorded too.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

from dtrain.training import CheckpointManager
from dtrain.training.dcp import ModelState
from dtrain.training.dist import exit_now, init_distributed

HIDDEN = 4096
#: moto assembles a multipart upload in its one Python process: on 2 busy cores that can outlast botocore's
#: 60 s read timeout, and the retried completion then fails on parts the first one consumed
S3_OPTIONS = {"config_kwargs": {"read_timeout": 900}}


def build(params_gib: float):
    layers = max(1, round(params_gib * (1 << 30) / 4 / (HIDDEN * HIDDEN)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), layers


def train_step(model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(4, HIDDEN)).pow(2).mean().backward()
    optimizer.step()


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def options_for(url: str) -> dict:
    return S3_OPTIONS if url.startswith("s3://") else {}


def torch_save_rank0(model, optimizer, url: str) -> float:
    import fsspec

    started = time.perf_counter()
    m, o = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        with fsspec.open(url, "wb", **options_for(url)) as fh:
            torch.save({"model": m, "optimizer": o}, fh)
            if not url.startswith("s3://"):  # a local file: durable like the DCP shards (fsynced)
                fh.flush()
                os.fsync(fh.fileno())
    dist.barrier()
    return slowest(time.perf_counter() - started)


def torch_load_rank0(model, optimizer, url: str) -> float:
    import fsspec

    started = time.perf_counter()
    state = {"model": {}, "optimizer": {}}
    if dist.get_rank() == 0:
        with fsspec.open(url, "rb", **options_for(url)) as fh:
            state = torch.load(fh, map_location="cpu", weights_only=False)
    # Model and optimizer apart: set_state_dict skips the model's broadcast on ranks given an empty
    # model dict (it takes them for optimizer-only), and rank 0 then waits for them forever.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    return slowest(time.perf_counter() - started)


def dcp_round(model, optimizer, location: str, asynchronous: bool, step: int) -> dict[str, float]:
    ckpt = CheckpointManager(location, keep=1, format="dcp", async_save=asynchronous,
                             storage_options=options_for(location) or None)
    app = ModelState(model, optimizer)
    ckpt.save(step - 1, {"app": app})  # not timed: the first save makes the checkpoint's process group
    ckpt.wait()
    started = time.perf_counter()
    ckpt.save(step, {"app": app})
    stall = slowest(time.perf_counter() - started)
    if asynchronous:
        train_step(model, optimizer)  # training goes on while the upload runs
    ckpt.wait()
    dist.barrier()
    committed = slowest(time.perf_counter() - started)
    started = time.perf_counter()
    loaded = ckpt.load_latest(into={"app": app})
    assert loaded is not None and loaded["step"] == step
    return {"stall_s": stall, "committed_s": committed, "load_s": slowest(time.perf_counter() - started)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--location", required=True, help="a directory or s3:// prefix")
    p.add_argument("--params-gib", type=float, default=1.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    ctx = init_distributed()
    model, optimizer, layers = build(args.params_gib)
    train_step(model, optimizer)  # Adam's state exists from here
    params = sum(p.numel() for p in model.parameters())  # global: DTensor numel is the whole tensor's
    results: dict[str, dict[str, float]] = {}
    folder = f"{args.location.rstrip('/')}/torch"
    if "://" not in folder:
        os.makedirs(folder, exist_ok=True)
    # Two keys: moto fails a multipart upload that replaces a key written by one ("seek of closed file").
    torch_save_rank0(model, optimizer, f"{folder}/warmup.pt")  # not timed, like the first DCP save of each round
    url = f"{folder}/model.pt"
    results["torch.save"] = {"stall_s": torch_save_rank0(model, optimizer, url)}
    results["torch.save"]["load_s"] = torch_load_rank0(model, optimizer, url)
    results["dcp-sync"] = dcp_round(model, optimizer, f"{args.location.rstrip('/')}/sync", False, 2)
    results["dcp-async"] = dcp_round(model, optimizer, f"{args.location.rstrip('/')}/async", True, 2)
    if ctx.rank == 0:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"results": results, "params": params, "layers": layers, "world": ctx.world_size}, fh)
    return 0


if __name__ == "__main__":
    exit_now(main())
