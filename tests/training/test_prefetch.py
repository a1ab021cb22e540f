"""DevicePrefetcher on a CPU: the same batches in the same order as ShardLoader for every collate, the
thread gone when an iteration is abandoned, a resumed epoch's skipped batches, and the pinned ring's
slot reuse and byte bound (with a stand-in for CUDA events: MockCudaEvent). The CUDA copy itself runs
in bench/gpu_feed.py on a GPU."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

from dtrain.preprocess.runner import preprocess
from dtrain.training.prefetch import ALIGN, DevicePrefetcher, PinnedRing, flatten, packed_offsets, views
from dtrain.training.shards import COLLATES, Padded, ShardDataset, ShardLoader, ShardSampler

from tests.preprocess.conftest import write_jsonl
from tests.preprocess.var_transforms import records

FIELDS = ("ids", "blob", "label")


@pytest.fixture(scope="module")
def mixed_shards(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("prefetch")
    raw = write_jsonl(str(root / "docs.jsonl"), records(300))
    out = str(root / "shards")
    preprocess([raw], out, "tests.preprocess.var_transforms:mixed", workers=1, shard_size=64, log=lambda _: None)
    return out


def loader_of(shards: str, collate: str = "list", cache_bytes: int = 0, read_ahead: int = 3) -> ShardLoader:
    dataset = ShardDataset(shards, fields=FIELDS, cache_bytes=cache_bytes)
    sampler = ShardSampler(len(dataset), num_replicas=1, rank=0, seed=3)
    return ShardLoader(dataset, 16, sampler, read_ahead=read_ahead, collate=collate, drop_last=False)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def prefetch_threads() -> int:
    return sum(t.name == "dtrain-prefetch" for t in threading.enumerate())


@pytest.mark.parametrize("collate", COLLATES)
@pytest.mark.parametrize("cache_bytes", [0, 1 << 30])
def test_prefetcher_yields_the_loaders_batches_in_order(mixed_shards, collate, cache_bytes):
    loader = loader_of(mixed_shards, collate, cache_bytes)
    expected = list(loader)
    got = list(DevicePrefetcher(loader, "cpu"))
    assert len(got) == len(expected) == len(DevicePrefetcher(loader)) > 3 * 3  # more than one block
    assert all(same(g, e) for g, e in zip(got, expected))
    assert any(isinstance(b[0], Padded) if collate == "pad" else isinstance(b[0], list) for b in got)
    assert prefetch_threads() == 0


@pytest.mark.parametrize("collate", COLLATES)
def test_flattened_batches_rebuild_equal_through_one_packed_buffer(mixed_shards, collate):
    """What the CUDA copier does, with a CPU buffer for the pinned and the device one."""
    for block in loader_of(mixed_shards, collate).blocks():
        leaves: list = []
        rebuild = [flatten(batch, leaves) for batch in block]
        offsets, nbytes = packed_offsets(leaves)
        assert all(o % ALIGN == 0 for o in offsets) and nbytes % ALIGN == 0
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        for place, leaf in zip(views(buffer, leaves, offsets), leaves):
            place.copy_(leaf)
        copies = views(buffer.clone(), leaves, offsets)
        assert all(same(part(copies), batch) for part, batch in zip(rebuild, block))


def test_a_plain_iterable_is_prefetched_batch_by_batch():
    batches = [(torch.full((2,), i),) for i in range(7)]
    assert all(same(g, e) for g, e in zip(DevicePrefetcher(batches), batches))


@pytest.mark.parametrize("how", ["break", "del", "exception", "close"])
def test_abandoning_the_iteration_stops_the_thread(mixed_shards, how):
    loader = loader_of(mixed_shards, read_ahead=1)
    before = prefetch_threads()
    if how == "break":
        for _ in DevicePrefetcher(loader, depth=1):
            assert prefetch_threads() == before + 1
            break
    elif how == "del":
        iterator = iter(DevicePrefetcher(loader, depth=1))
        next(iterator)
        assert prefetch_threads() == before + 1
        del iterator
    elif how == "exception":
        def train():
            for _ in DevicePrefetcher(loader, depth=1):
                raise RuntimeError("the step failed")
        with pytest.raises(RuntimeError, match="the step failed"):
            train()
    else:
        iterator = iter(DevicePrefetcher(loader, depth=1))
        next(iterator)
        iterator.close()
    gc.collect()
    assert prefetch_threads() == before


def test_a_loader_error_reaches_the_training_loop_and_the_thread_ends():
    def broken():
        yield (torch.zeros(1),)
        raise OSError("shard file vanished")

    iterator = iter(DevicePrefetcher(broken()))
    next(iterator)
    with pytest.raises(OSError, match="shard file vanished"):
        next(iterator)
    assert prefetch_threads() == 0


def test_a_resumed_epoch_skips_batches_with_next(mixed_shards):
    """TrainLoop resumes mid-epoch by calling next() on the iterator as many times as steps were trained."""
    loader = loader_of(mixed_shards)
    expected = list(loader)
    iterator = iter(DevicePrefetcher(loader))
    for _ in range(5):
        next(iterator)
    assert all(same(g, e) for g, e in zip(iterator, expected[5:]))
    assert prefetch_threads() == 0


class MockCudaEvent:
    """A stand-in for torch.cuda.Event (no GPU here): ``synchronize`` is when the copy it marks completes."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(self.name)


def test_ring_reuses_a_slot_only_after_its_copy_completed_and_stays_within_its_largest_blocks():
    made: list[int] = []
    ring = PinnedRing(3, lambda n: made.append(n) or bytearray(n))
    waited: list = []
    sizes = [100, 300, 200, 250, 50, 400]
    for i, size in enumerate(sizes):
        slot, buffer = ring.acquire(size)
        assert slot == i % 3 and len(buffer) >= size
        # the slot's previous copy (block i - 3) was waited for before the slot was handed out again
        assert waited == [f"copy {j}" for j in range(max(0, i - 2))]
        ring.release(slot, MockCudaEvent(waited, f"copy {i}"))
    # grown only when a block was larger than its slot's buffer: 100, 300, 200, then 250, 400 (slot 0, 2)
    assert made == [100, 300, 200, 250, 400]
    assert ring.nbytes() == 250 + 300 + 400  # each slot the largest block it served: bounded by 3 blocks
    with pytest.raises(ValueError, match="at least 2"):
        PinnedRing(1, bytearray)


def test_read_ahead_on_the_thread_is_bounded_by_depth(mixed_shards):
    """The thread is at most ``depth`` blocks ahead (plus the one it reads): memory stays level."""
    taken: list[int] = []

    def counted():
        for i, block in enumerate(loader_of(mixed_shards, read_ahead=1).blocks()):
            taken.append(i)
            yield block

    prefetcher = DevicePrefetcher(loader_of(mixed_shards), depth=2)
    prefetcher._blocks = counted  # the blocks it reads, counted
    iterator = iter(prefetcher)
    next(iterator)
    for _ in range(200):  # let the thread fill the queue
        if len(taken) >= 4:
            break
        threading.Event().wait(0.01)
    assert len(taken) <= 1 + 2 + 1  # handed out, queued (depth), being put
    iterator.close()
    assert prefetch_threads() == 0
    assert np.all(np.diff(taken) == 1)


def test_a_device_it_cannot_feed_is_refused_when_made():
    with pytest.raises(ValueError, match="depth=0"):
        DevicePrefetcher([], "cpu", depth=0)
    with pytest.raises(ValueError, match="copies to 'cuda' devices"):
        DevicePrefetcher([], "meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            DevicePrefetcher([], "cuda")
