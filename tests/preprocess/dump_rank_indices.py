"""Launched on every rank: read the shard dataset's ``i`` field through ShardSampler for two epochs
and write what this rank saw to $OUT_DIR/rank{R}.json (the test checks the split across ranks)."""

from __future__ import annotations

import json
import os
import sys

from torch.utils.data import DataLoader

from dtrain.training.shards import ShardDataset, ShardSampler


def main() -> int:
    shards, out_dir = sys.argv[1], os.environ["OUT_DIR"]
    dataset = ShardDataset(shards, fields=("i",))
    sampler = ShardSampler(len(dataset), seed=7)  # rank and world size from the launcher's env
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    seen = {}
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        seen[str(epoch)] = [int(v) for (batch,) in loader for v in batch]
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w", encoding="utf-8") as fh:
        json.dump({"world_size": int(os.environ["WORLD_SIZE"]), "seen": seen}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
