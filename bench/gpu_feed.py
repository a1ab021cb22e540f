"""The feed: tokens per second of the text example's CausalLM fed three ways, quiet and with half the cores busy.

- ceiling: the same model fed from batches already on the device (no loader at all);
- ours: ``DevicePrefetcher(ShardLoader(...), device)``: one thread, a pinned ring, a side-stream copy;
- DataLoader: ``torch.utils.data.DataLoader`` over the same ShardDataset, 4 worker processes, pinned memory,
  ``.to(device, non_blocking=True)``.

Small model (width 128, 2 layers, batch 256) and medium (width 512, 6 layers, batch 64), bf16 autocast,
fused AdamW; the loss is read every 50 steps (no host-device sync per step). The shards are written by the
product's preprocessing (packed uint16 blocks of 129 tokens, as the text example stores them). Goal: ours at
least 0.98 of the ceiling and at least DataLoader's rate, on both models, quiet and loaded.

    PYTHONPATH=operators python3 bench/gpu_feed.py            # about 2 minutes on one GPU with 16 cores
    PYTHONPATH=operators python3 bench/gpu_feed.py --quick    # a CPU smoke run of seconds; judges nothing
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Callable, Iterator

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "text"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "operators"))

from gpu_common import Line, ModelSize, judged, part_main  # noqa: E402

from dtrain.preprocess.transform import variable_length  # noqa: E402

BLOCK = 129  # 128 tokens of context and the one after: the text example's packed block
VOCAB = 512  # the text example's tokenizer
READ_LOSS_EVERY = 50


Size = ModelSize
SIZES = (Size("small", 128, 2, 256), Size("medium", 512, 6, 64))
QUICK = Size("tiny", 32, 1, 8)


@variable_length("input_ids")
def token_ids(record: dict) -> dict:
    """A document's token ids (the preprocessing transform of the bench's shards)."""
    return {"input_ids": np.asarray(record["ids"], dtype=np.uint16)}


def write_shards(workdir: str, blocks: int) -> str:
    """``blocks`` packed blocks of random documents, through the product's preprocessing."""
    import json

    from dtrain.preprocess.runner import preprocess

    rng = np.random.default_rng(0)
    raw = os.path.join(workdir, "docs.jsonl")
    with open(raw, "w", encoding="utf-8") as out:
        written = 0
        while written < blocks * BLOCK:
            n = int(rng.integers(50, 2000))
            out.write(json.dumps({"ids": rng.integers(1, VOCAB, n).tolist()}) + "\n")
            written += n
    shards = os.path.join(workdir, "shards")
    preprocess([raw], shards, "gpu_feed:token_ids", workers=1 if blocks < 1000 else 4, shard_size=4096,
               pack={"field": "input_ids", "block_size": BLOCK, "separator": 0}, log=lambda _: None)
    return shards


def make_step(size: Size, device: str) -> Callable:
    """One training step without a host-device sync: forward, backward, fused AdamW."""
    import torch
    from text_pipeline import model as lm

    torch.manual_seed(0)
    model = lm.CausalLM(VOCAB, BLOCK - 1, width=size.width, heads=4, layers=size.layers).to(device)
    fused = {"fused": True} if device.startswith("cuda") else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **fused)
    dtype = torch.bfloat16

    def step(block):
        with torch.autocast(torch.device(device).type, dtype=dtype):
            loss = lm.next_token_loss(model, block)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def tokens_per_second(step: Callable, batches: Callable[[], Iterator], steps: int, warmup: int, batch: int,
                      device: str) -> float:
    """Run ``warmup`` then ``steps`` steps over ``batches()`` (restarted each epoch); tokens trained per second."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    done, start = 0, 0.0
    while done < warmup + steps:
        for (block,) in batches():
            if done == warmup:
                sync()
                start = time.perf_counter()
            loss = step(block)
            done += 1
            if done % READ_LOSS_EVERY == 0:
                loss.item()  # the only read of the loss: every 50 steps, as a training loop logs it
            if done == warmup + steps:
                break
    sync()
    return steps * batch * (BLOCK - 1) / (time.perf_counter() - start)


def feeds(shards: str, size: Size, device: str, quick: bool) -> dict[str, Callable[[], Iterator]]:
    import torch
    from torch.utils.data import DataLoader

    from dtrain.training.prefetch import DevicePrefetcher
    from dtrain.training.shards import ShardDataset, ShardLoader, ShardSampler

    dataset = ShardDataset(shards, fields=("input_ids",), cache_bytes=0)  # memory-mapped, as large datasets are
    sampler = ShardSampler(len(dataset), num_replicas=1, rank=0)
    first = next(iter(ShardLoader(dataset, size.batch, sampler)))[0]
    resident = [first.roll(i, 0).to(device) for i in range(8)]  # the ceiling: no loader, batches on the device
    ours = DevicePrefetcher(ShardLoader(dataset, size.batch, sampler), device)
    workers = DataLoader(dataset, batch_size=size.batch, sampler=sampler, drop_last=True, num_workers=4,
                         pin_memory=device.startswith("cuda"), persistent_workers=True, prefetch_factor=4)

    def epoch(loader):
        sampler.set_epoch(sampler.epoch + 1)
        return iter(loader)

    return {
        "ceiling": lambda: ((b,) for b in resident * 64),
        "ours": lambda: epoch(ours),
        "DataLoader": lambda: ((b.to(device, non_blocking=True),) for (b,) in epoch(workers)),
    }


@contextlib.contextmanager
def busy_cores(count: int):
    """``count`` processes spinning on a CPU core each (the loaded case), stopped on the way out."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
        for proc in spinners:
            proc.wait()


def measure(shards: str, size: Size, device: str, quick: bool, load: str) -> Line:
    steps, warmup = (6, 2) if quick else (400, 40)
    step = make_step(size, device)
    rate = {name: tokens_per_second(step, batches, steps, warmup, size.batch, device)
            for name, batches in feeds(shards, size, device, quick).items()}
    ceiling, ours, peer = rate["ceiling"], rate["ours"], rate["DataLoader"]
    text = (f"ceiling {ceiling / 1e6:.3f}M tok/s, ours {ours / 1e6:.3f}M ({ours / ceiling:.3f} of it), "
            f"DataLoader 4 workers pinned {peer / 1e6:.3f}M ({peer / ceiling:.3f}); ours/DataLoader {ours / peer:.3f}")
    return Line(f"feed: {size.name} model (width {size.width}, {size.layers} layers, batch {size.batch}), {load}",
                text, judged(ours >= 0.98 * ceiling and ours >= peer, quick))


def python_rate(seconds: float) -> float:
    """Loop turns per second of a pure-Python loop: what the training thread gets of the interpreter."""
    turns, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        turns += 1
    return turns / seconds


def gather_line(shards: str, quick: bool) -> Line:
    """Whether the gather releases the GIL: the training thread's Python pace while a thread gathers, against alone."""
    import threading

    from dtrain.training.shards import ShardDataset

    dataset = ShardDataset(shards, fields=("input_ids",), cache_bytes=0)
    rows = np.random.default_rng(0).permutation(len(dataset))[: 64 if quick else 8192]
    seconds = 0.2 if quick else 2.0
    alone = python_rate(seconds)
    stop, gathers = threading.Event(), [0]

    def gather():
        while not stop.is_set():
            dataset.gather(rows)
            gathers[0] += 1

    thread = threading.Thread(target=gather)
    thread.start()
    try:
        beside = python_rate(seconds)
    finally:
        stop.set()
        thread.join()
    return Line(f"feed: gather of {len(rows)} blocks on a thread", f"{gathers[0] / seconds:.0f} gathers/s; the "
                f"training thread's Python {beside / 1e6:.2f}M turns/s beside it vs {alone / 1e6:.2f}M alone "
                f"({beside / alone:.2f})")


def lines(device: str, quick: bool, workdir: str) -> Iterator[Line]:
    shards = write_shards(workdir, 400 if quick else 40000)
    yield gather_line(shards, quick)
    sizes = (QUICK,) if quick else SIZES
    half = max(1, (os.cpu_count() or 2) // 2)
    for size in sizes:
        yield measure(shards, size, device, quick, "quiet")
        with busy_cores(half):
            yield measure(shards, size, device, quick, f"{half} cores busy")


def main(argv: list[str] | None = None) -> int:
    return part_main(lines, argv)


if __name__ == "__main__":
    sys.exit(main())
