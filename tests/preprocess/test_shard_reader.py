"""The shard reader's rank split: disjoint, complete, equal-sized per epoch on 2 and 4 ranks, a new
order every epoch; checked in-process and on 4 real ranks started by the launcher."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest
import torch

from dtrain.preprocess.runner import preprocess
from dtrain.training.shards import ShardDataset, ShardSampler

from .conftest import HERE, launch

INDEXED = "tests.preprocess.prep_transforms:indexed_row"


@pytest.fixture(scope="module")
def indexed_shards(tmp_path_factory) -> str:
    """1200 samples (divisible by 2 and 4) whose field i is the sample's id, in 10 shards."""
    root = tmp_path_factory.mktemp("indexed")
    np.save(root / "rows.npy", np.column_stack([np.arange(1200), np.ones((1200, 2))]))
    preprocess([str(root / "rows.npy")], str(root / "out"), INDEXED, workers=1, shard_size=120, log=lambda _: None)
    return str(root / "out")


def check_split(per_rank: list[list[int]], n: int) -> None:
    sizes = {len(r) for r in per_rank}
    assert sizes == {n // len(per_rank)}  # equal counts: DDP never waits for a rank with a batch fewer
    flat = [i for r in per_rank for i in r]
    assert len(flat) == len(set(flat)) == n and set(flat) == set(range(n))  # disjoint and complete


@pytest.mark.parametrize("world", [2, 4])
def test_split_is_disjoint_complete_equal_and_reshuffled_each_epoch(indexed_shards, world):
    dataset = ShardDataset(indexed_shards, fields=("i",))
    epochs = []
    for epoch in (0, 1):
        per_rank = []
        for rank in range(world):
            sampler = ShardSampler(len(dataset), num_replicas=world, rank=rank, seed=3)
            sampler.set_epoch(epoch)
            per_rank.append([int(dataset[k][0]) for k in sampler])
        check_split(per_rank, 1200)
        epochs.append(per_rank)
    assert all(a != b for a, b in zip(*epochs))  # every rank sees a different order in epoch 1


def test_uneven_counts_pad_or_drop_but_stay_equal():
    n, world = 1437, 4
    padded = [ShardSampler(n, world, r).indices() for r in range(world)]
    assert {len(p) for p in padded} == {360}
    counts = Counter(i for p in padded for i in p)
    assert set(counts) == set(range(n)) and sum(c - 1 for c in counts.values()) == 3  # all seen, 3 twice
    dropped = [ShardSampler(n, world, r, drop_last=True).indices() for r in range(world)]
    flat = [i for p in dropped for i in p]
    assert {len(p) for p in dropped} == {359} and len(set(flat)) == len(flat) == 1436
    with pytest.raises(ValueError, match="rank=4"):
        ShardSampler(n, 4, 4)


def test_batched_reads_equal_per_sample_reads(digits_shards):
    dataset = ShardDataset(digits_shards)
    picks = [1436, 0, 201, 199, 200, 5, 999, -1]
    x, y = dataset.get_batch(picks)
    assert torch.equal(x, torch.stack([dataset[i][0] for i in picks]))
    assert torch.equal(y, torch.stack([dataset[i][1] for i in picks]))
    assert x.dtype == torch.float32 and x.shape == (8, 64) and y.dtype == torch.int64 and dataset[3][1].shape == ()
    with pytest.raises(IndexError):
        dataset.get_batch([1437])


def test_four_launched_ranks_split_the_shards(tmp_path, indexed_shards):
    out = tmp_path / "seen"
    out.mkdir()
    launch(4, str(tmp_path / "run"), os.path.join(HERE, "dump_rank_indices.py"), indexed_shards, OUT_DIR=str(out))
    reports = [json.load(open(out / f"rank{r}.json", encoding="utf-8")) for r in range(4)]
    assert {r["world_size"] for r in reports} == {4}
    for epoch in ("0", "1"):
        check_split([r["seen"][epoch] for r in reports], 1200)
    assert all(r["seen"]["0"] != r["seen"]["1"] for r in reports)


def test_cached_and_memory_mapped_reads_agree_and_shard_loader_batches(digits_shards):
    from dtrain.training.shards import ShardLoader

    cached, mapped = ShardDataset(digits_shards), ShardDataset(digits_shards, cache_bytes=0)
    assert cached.cached and not mapped.cached
    picks = list(range(1436, -1, -97))
    for a, b in zip(cached.get_batch(picks), mapped.get_batch(picks)):
        assert torch.equal(a, b)
    assert torch.equal(cached[5][0], mapped[5][0]) and int(cached[-1][1]) == int(mapped[1436][1])
    sampler = ShardSampler(len(mapped), num_replicas=2, rank=1, seed=5, drop_last=True)
    sampler.set_epoch(3)
    loader = ShardLoader(mapped, batch_size=50, sampler=sampler, read_ahead=4)
    batches = list(loader)
    assert len(batches) == len(loader) == 718 // 50 and all(x.shape == (50, 64) for x, _ in batches)
    order = sampler.indices()[: 14 * 50]
    expected = mapped.get_batch(order)
    assert torch.equal(torch.cat([x for x, _ in batches]), expected[0])
    assert torch.equal(torch.cat([y for _, y in batches]), expected[1])


def test_shard_loader_bounds_its_read_ahead_in_bytes(digits_shards):
    """Large samples must not make a block of `read_ahead` batches hundreds of MB: the block is capped in
    bytes (at least one batch), and the batches are the same whatever the block size."""
    from dtrain.training.shards import ShardLoader

    dataset = ShardDataset(digits_shards, cache_bytes=0)
    assert dataset.sample_nbytes == 64 * 4 + 8  # x float32 (64,), y int64
    gathered = []
    gather = dataset.gather
    dataset.gather = lambda idx: gathered.append(len(idx)) or gather(idx)
    sampler = ShardSampler(len(dataset), num_replicas=1, rank=0, seed=2, drop_last=True)
    capped = ShardLoader(dataset, batch_size=50, sampler=sampler, read_ahead=64, read_ahead_bytes=3 * 50 * 264 + 1)
    assert capped.block_batches() == 3
    batches = list(capped)
    assert len(batches) == 1437 // 50 and max(gathered) == 150
    assert ShardLoader(dataset, 4, sampler).block_batches() == 64  # small batches of small samples: below the cap
    assert ShardLoader(dataset, 50, sampler).block_batches() == (512 << 10) // (50 * 264)  # 512 KiB
    assert ShardLoader(dataset, 50, sampler, read_ahead_bytes=1).block_batches() == 1
    whole = ShardLoader(dataset, batch_size=50, sampler=sampler, read_ahead=64)
    for (x1, y1), (x2, y2) in zip(batches, whole, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.mark.parametrize("cache_bytes", [1 << 30, 0], ids=["cached", "mapped"])
def test_reader_refuses_a_shard_whose_array_differs_from_the_manifest(tmp_path, digits_shards, cache_bytes):
    """A field file of the right size whose array has another shape is refused with the file named, whether
    the dataset is read into memory (straight from the files) or memory-mapped."""
    import shutil

    from dtrain.preprocess.errors import PreprocessError

    copy = str(tmp_path / "copy")
    shutil.copytree(digits_shards, copy)
    manifest = json.load(open(os.path.join(copy, "manifest.json"), encoding="utf-8"))
    victim = os.path.join(copy, manifest["shards"][1]["files"]["x"]["path"])
    good = np.load(victim)
    np.save(victim, good.reshape(len(good) * 2, 32))  # same bytes, same header length: only the shape differs
    assert os.path.getsize(victim) == manifest["shards"][1]["files"]["x"]["bytes"]
    dataset = ShardDataset(copy, cache_bytes=cache_bytes)
    assert dataset.cached == bool(cache_bytes)
    with pytest.raises(PreprocessError, match=r"holds float32 \(400, 32\), manifest says float32 \(200, 64\)"):
        dataset.get_batch(range(len(dataset)))
    np.save(victim, good.astype(">f4"))  # another byte order of the same values: converted, not refused
    x, _ = ShardDataset(copy, cache_bytes=cache_bytes).get_batch(range(200, 400))
    assert torch.equal(x, torch.from_numpy(good))
