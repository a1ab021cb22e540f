"""Keep a GPU fed from a loader: read and copy the next batches off the training thread.

    loader = DevicePrefetcher(ShardLoader(dataset, 256, sampler), "cuda")
    for (ids,) in loader:          # already on the GPU, ordered before the step on the current stream
        loss = step(ids)

One thread (no worker processes) iterates the wrapped loader: the gather of a block (numpy releases the
GIL while it copies), then, on CUDA, a copy of the block's tensors into a pinned buffer of a small ring
and one host-to-device copy of that buffer on a side stream. The training stream waits for that copy
on the GPU (an event), never on the host, so a step never runs the loader's work between steps.

Memory stays level and bounded in bytes: the wrapped loader's read-ahead block, ``depth`` blocks
copied and queued (on the device), and the ring's ``depth + 1`` pinned buffers, each the size of the
largest block seen. A pinned buffer's only reader is its host-to-device copy, so it is refilled once
that copy's event has completed; the device copy belongs to the batches (the caching allocator is told
with ``record_stream`` that the training stream uses it), so batches stay valid as long as they are held.

On the CPU device the batches are the wrapped loader's own, read ahead by the thread. Breaking out of the loop, dropping the iterator or an exception in the loop stops the
thread; a resumed epoch skips batches with ``next()`` as with any iterator.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator

from dtrain.training.shards import Padded

ALIGN = 64  # bytes: every tensor in a pinned buffer starts on a boundary any dtype's view accepts
_DONE = object()


class PinnedRing:
    """``slots`` reusable host buffers (pinned on CUDA), each grown to the largest request it served.

    A slot is handed out again only once the event recorded after its last use has completed
    (``event.synchronize()``: the producer thread waits, not the training thread). ``allocate(nbytes)``
    makes a buffer and ``events`` stand for CUDA events; the CPU tests give stand-ins for both.
    """

    def __init__(self, slots: int, allocate: Callable[[int], Any]):
        if slots < 2:
            raise ValueError(f"slots={slots}: a ring needs at least 2 (one filled while one is copied)")
        self.allocate = allocate
        self.buffers: list[Any] = [None] * slots
        self.capacity = [0] * slots
        self.pending: list[Any] = [None] * slots  # the event after the slot's last use
        self.next = 0

    def acquire(self, nbytes: int) -> tuple[int, Any]:
        """The next slot, once its last use completed, with a buffer of at least ``nbytes``."""
        slot = self.next
        self.next = (slot + 1) % len(self.buffers)
        if self.pending[slot] is not None:
            self.pending[slot].synchronize()
            self.pending[slot] = None
        if self.capacity[slot] < nbytes:
            self.buffers[slot] = None  # the old buffer goes before the new one is made: bytes stay bounded
            self.buffers[slot] = self.allocate(nbytes)
            self.capacity[slot] = nbytes
        return slot, self.buffers[slot]

    def release(self, slot: int, event: Any) -> None:
        self.pending[slot] = event

    def nbytes(self) -> int:
        return sum(self.capacity)


# -- a batch as flat tensors and a way to rebuild it from their copies ---------------------------------

def flatten(batch: Any, leaves: list) -> Callable[[list], Any]:
    """Append ``batch``'s tensors to ``leaves`` (contiguous); return what rebuilds the batch from copies
    of them. A list of 1-D tensors (collate="list") becomes one tensor and comes back as views of it;
    anything not a tensor (bytes, numbers) comes back as it is."""
    import torch

    if isinstance(batch, torch.Tensor):
        index = len(leaves)
        leaves.append(batch.contiguous())
        return lambda copies: copies[index]
    if isinstance(batch, Padded):
        values, mask = flatten(batch.values, leaves), flatten(batch.mask, leaves)
        return lambda copies: Padded(values(copies), mask(copies))
    if isinstance(batch, list) and batch and all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in batch) \
            and len({t.dtype for t in batch}) == 1:
        index, lengths = len(leaves), [len(t) for t in batch]
        leaves.append(torch.cat(batch))
        return lambda copies: list(copies[index].split(lengths))
    if isinstance(batch, (tuple, list)):
        parts = [flatten(item, leaves) for item in batch]
        kind = type(batch)
        return lambda copies: kind(part(copies) for part in parts)
    return lambda copies: batch


def packed_offsets(leaves: list) -> tuple[list[int], int]:
    """Where each leaf starts in one buffer (aligned), and the buffer's size."""
    offsets, end = [], 0
    for leaf in leaves:
        offsets.append(end)
        end += -(-leaf.numel() * leaf.element_size() // ALIGN) * ALIGN
    return offsets, max(end, ALIGN)


def views(buffer: Any, leaves: list, offsets: list[int]) -> list:
    """Each leaf's place in ``buffer`` (a uint8 tensor) as a tensor of the leaf's dtype and shape."""
    return [buffer[start:start + leaf.numel() * leaf.element_size()].view(leaf.dtype).view(leaf.shape)
            for leaf, start in zip(leaves, offsets)]


# -- the copy to the device ---------------------------------------------------------------------------

class CudaCopier:
    """A block's batches -> the same batches on the device, through the pinned ring and a side stream."""

    def __init__(self, device: Any, slots: int):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.consumer = torch.cuda.current_stream(self.device)  # the training stream, when iteration starts
        self.ring = PinnedRing(slots, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))

    def __call__(self, batches: list) -> list:
        torch = self.torch
        leaves: list = []
        rebuild = [flatten(batch, leaves) for batch in batches]
        offsets, nbytes = packed_offsets(leaves)
        slot, pinned = self.ring.acquire(nbytes)
        for host, leaf in zip(views(pinned, leaves, offsets), leaves):
            host.copy_(leaf)  # a memcpy that releases the GIL
        with torch.cuda.stream(self.stream):
            device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            device_buffer.copy_(pinned, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        self.ring.release(slot, copied)
        device_buffer.record_stream(self.consumer)  # its memory is not reused before the training stream is done
        self.consumer.wait_event(copied)  # the training stream's later work waits for the copy, on the GPU
        copies = views(device_buffer, leaves, offsets)
        return [part(copies) for part in rebuild]


# -- the prefetching iterator -------------------------------------------------------------------------

class DevicePrefetcher:
    """Iterate ``loader`` with its blocks read (and, on CUDA, copied to ``device``) by a thread.

    Args:
        loader: a :class:`~dtrain.training.shards.ShardLoader` (read block by block) or any iterable of
            batches (then each batch is a block).
        device: where the batches go: "cuda", "cuda:1", a torch.device, or "cpu" (read ahead only).
        depth: blocks ready ahead of the training loop (default 2); bounds the memory with the block size.
    """

    def __init__(self, loader: Iterable, device: Any = "cpu", depth: int = 2):
        import torch

        if depth < 1:
            raise ValueError(f"depth={depth} must be at least 1")
        self.loader, self.device, self.depth = loader, torch.device(device), depth
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: DevicePrefetcher copies to 'cuda' devices (or reads ahead on 'cpu')")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but torch sees no CUDA device (torch.cuda.is_available() is False)")

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _blocks(self) -> Iterator[list]:
        blocks = getattr(self.loader, "blocks", None)
        return blocks() if callable(blocks) else ([batch] for batch in self.loader)

    def _copier(self) -> Callable[[list], list] | None:
        if self.device.type == "cuda":
            return CudaCopier(self.device, self.depth + 1)  # one slot more than blocks queued: one is being filled
        return None

    def __iter__(self) -> Iterator:
        return Prefetching(self._blocks(), self._copier(), self.depth)


class Prefetching:
    """One iteration: the thread, its bounded queue of blocks, and the block being handed out.

    The thread holds no reference to this object, so dropping it (a ``break``, ``del``, an exception
    unwinding the loop) finalizes it, and that stops and joins the thread."""

    def __init__(self, blocks: Iterator[list], copier: Callable[[list], list] | None, depth: int):
        self.ready: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.current: Iterator = iter(())
        self.thread = threading.Thread(target=_produce, args=(blocks, copier, self.ready, self.stop),
                                       name="dtrain-prefetch", daemon=True)
        self.thread.start()

    def __iter__(self) -> "Prefetching":
        return self

    def __next__(self):
        while True:
            batch = next(self.current, _DONE)
            if batch is not _DONE:
                return batch
            block = self.ready.get()
            if block is _DONE:
                self.close()
                raise StopIteration
            if isinstance(block, BaseException):
                self.close()
                raise block
            self.current = iter(block)

    def close(self) -> None:
        """Stop the thread and wait for it (it finishes at most the block it is reading)."""
        self.stop.set()
        while getattr(self, "thread", None) is not None and self.thread.is_alive():
            try:
                self.ready.get(timeout=0.05)  # unblock a put
            except queue.Empty:
                pass
        self.current = iter(())

    def __del__(self) -> None:
        self.close()


def _produce(blocks: Iterator[list], copier: Callable[[list], list] | None, ready: queue.Queue,
             stop: threading.Event) -> None:
    """The thread: read blocks (and copy them) until the loader ends or ``stop`` is set."""
    try:
        for block in blocks:
            item = copier(block) if copier is not None else block
            if not _put(ready, item, stop):
                return
        _put(ready, _DONE, stop)
    except BaseException as error:  # handed to the training loop, raised there
        _put(ready, error, stop)
    finally:
        close = getattr(blocks, "close", None)
        if close is not None:
            close()  # a generator's own cleanup runs on this thread, now


def _put(ready: queue.Queue, item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False
