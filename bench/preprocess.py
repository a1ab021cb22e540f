"""Benchmark: preprocess once into shards versus transform on the fly while training.

Trains the reference digits MLP for a fixed number of steps with a CPU-heavy transform
(dtrain.preprocess.examples:digits_heavy):
  (a) applied on the fly in a DataLoader with 2 worker processes,
  (b) applied once by `dtrain preprocess`'s engine, then read from memory-mapped shards,
and prints one line with samples/s of each, the speedup and each one's data-wait fraction
(time blocked in next(loader) / step time, as the training helper's metrics measure it).
Then preprocessing throughput with 1 and with 2 processes (records/s and input MB/s).

    .venv/bin/python bench/preprocess.py [--steps 400] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEAVY = "dtrain.preprocess.examples:digits_heavy"
WARMUP_STEPS = 5  # DataLoader worker start-up is not the steady state either way


class OnTheFly:
    """Raw records in memory; the heavy transform runs per sample in the DataLoader's workers."""

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        import torch

        from dtrain.preprocess.examples import digits_heavy

        out = digits_heavy(self.records[i])
        return torch.from_numpy(out["x"]), torch.tensor(out["y"])


def train(loader, steps: int, batch: int) -> tuple[float, float]:
    """Run ``steps`` steps of the reference model; returns (samples/s, data-wait fraction) after warm-up."""
    import torch

    from dtrain.training.reference.train_digits import build_model

    torch.manual_seed(0)
    model = build_model(128)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    step, wait, total, epoch = 0, 0.0, 0.0, 0
    while step < steps + WARMUP_STEPS:
        if hasattr(loader.sampler, "set_epoch"):  # the shard sampler reshuffles per epoch
            loader.sampler.set_epoch(epoch)
        batches = iter(loader)
        while step < steps + WARMUP_STEPS:
            t0 = time.perf_counter()
            try:
                x, y = next(batches)
            except StopIteration:
                break
            t1 = time.perf_counter()
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            t2 = time.perf_counter()
            if step >= WARMUP_STEPS:
                wait += t1 - t0
                total += t2 - t0
            step += 1
        epoch += 1
    return steps * batch / total, wait / total


def preprocess_timed(raw: str, out: str, workers: int) -> tuple[float, dict]:
    from dtrain.preprocess.runner import preprocess

    started = time.perf_counter()
    result = preprocess([raw], out, HEAVY, workers=workers, shard_size=512, log=lambda _: None)
    return time.perf_counter() - started, result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeat", type=int, default=4, help="copies of the 1437 training digits")
    p.add_argument("--loader-workers", type=int, default=2)
    args = p.parse_args()

    import torch
    from torch.utils.data import DataLoader

    from dtrain.preprocess.examples import digits_records, write_digits_jsonl
    from dtrain.training.shards import ShardDataset, ShardLoader, ShardSampler

    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 per rank; same for both sides
    tmp = tempfile.mkdtemp(prefix="dtrain-bench-preprocess-")
    try:
        raw = write_digits_jsonl(os.path.join(tmp, "raw"), partitions=1, repeat=args.repeat)[0]
        mb_in = os.path.getsize(raw) / 1e6

        timings = {}
        for workers in (1, 2):
            seconds, result = preprocess_timed(raw, os.path.join(tmp, f"shards-{workers}"), workers)
            timings[workers] = (seconds, result)
        n = timings[1][1]["records"]
        rate = {w: n / s for w, (s, _) in timings.items()}
        mb = {w: mb_in / s for w, (s, _) in timings.items()}

        records = digits_records(repeat=args.repeat)
        fly = DataLoader(OnTheFly(records), batch_size=args.batch_size, shuffle=True, drop_last=True,
                         num_workers=args.loader_workers, persistent_workers=True,
                         generator=torch.Generator().manual_seed(0))
        fly_rate, fly_wait = train(fly, args.steps, args.batch_size)
        del fly

        shards = ShardDataset(os.path.join(tmp, "shards-2"))  # small: read once into memory (cache_bytes)
        sampler = ShardSampler(len(shards), num_replicas=1, rank=0, drop_last=True)
        shard_rate, shard_wait = train(ShardLoader(shards, args.batch_size, sampler), args.steps, args.batch_size)
        mapped = ShardDataset(os.path.join(tmp, "shards-2"), cache_bytes=0)  # as a dataset bigger than memory
        map_rate, map_wait = train(ShardLoader(mapped, args.batch_size, sampler), args.steps, args.batch_size)

        print(f"train {args.steps} steps x {args.batch_size} (reference MLP, digits_heavy, {n} records): "
              f"on-the-fly DataLoader({args.loader_workers} workers) {fly_rate:.0f} samples/s, "
              f"data wait {fly_wait:.1%} | shards {shard_rate:.0f} samples/s, data wait {shard_wait:.1%} | "
              f"speedup {shard_rate / fly_rate:.1f}x | shards memory-mapped (no cache) {map_rate:.0f} samples/s, "
              f"data wait {map_wait:.1%}, speedup {map_rate / fly_rate:.1f}x")
        print(f"preprocess digits_heavy, {n} records, {mb_in:.1f} MB JSON lines: "
              f"1 process {rate[1]:.0f} records/s ({mb[1]:.2f} MB/s) | "
              f"2 processes {rate[2]:.0f} records/s ({mb[2]:.2f} MB/s) | ratio {rate[2] / rate[1]:.2f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
