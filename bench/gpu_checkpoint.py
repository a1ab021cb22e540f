"""Checkpoints on one device against the limits of the same run: the pinned device-to-host copy (the
floor of an asynchronous stall), the scratch folder's write+fsync and read bandwidth (the limits of a
synchronous save and a load), then ``CheckpointManager`` itself: torch.save, DCP synchronous save and
load, and DCP asynchronous over 5 saves with training steps between them.

State: a stack of bias-free 8192x8192 float32 Linear layers with Adam, 2 GiB of parameters and 6 GiB
in all (``--quick``: a few MB on the CPU, a smoke run that judges nothing). Every read is from the disk:
the page cache of each file is dropped after it is written and fsynced.

    python3 bench/gpu_checkpoint.py [--device cuda] [--quick] [--workdir DIR]
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "operators"))

from gpu_common import Line, judged, part_main  # noqa: E402

GIB = 1 << 30
SAVES = 5
#: goals
STALL_VS_COPY = 2.5
DISK_SHARE = 0.80
RATE_SHARE = 0.95


def build(device: str, quick: bool):
    import torch

    width, layers = (256, 4) if quick else (8192, 8)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False, device=device) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    batch = torch.randn(8 if quick else 64, width, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(batch).square().mean().backward()
        optimizer.step()
        sync(device)

    step()  # Adam's state exists from here
    return model, optimizer, step


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def state_bytes(model, optimizer) -> int:
    import torch

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for entries in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in entries.values() if isinstance(v, torch.Tensor))
    return total


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def gib_s(nbytes: int, seconds: float) -> str:
    return f"{nbytes / GIB / seconds:.2f} GiB/s"


def drop_cache(path: str) -> None:
    """Forget the page cache of ``path`` (a file or every file under a folder): the next read is the disk's."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def copy_floor(device: str, nbytes: int) -> float:
    """Seconds to copy ``nbytes`` from the device into pinned host memory (1 GiB at a time)."""
    import torch

    chunk = min(nbytes, GIB)
    src = torch.empty(chunk, dtype=torch.uint8, device=device)
    dst = torch.empty(chunk, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    dst.copy_(src, non_blocking=True)  # first-touch and launch costs out of the timing
    sync(device)

    def copies() -> None:
        for _ in range(-(-nbytes // chunk)):
            dst.copy_(src, non_blocking=True)
        sync(device)

    return timed(copies) * nbytes / (chunk * -(-nbytes // chunk))


def disk_limits(workdir: str, nbytes: int) -> tuple[float, float]:
    """Seconds to write+fsync and to read back ``nbytes`` in ``workdir`` (1 GiB writes, cache dropped)."""
    import numpy as np

    chunk = min(nbytes, GIB)
    block = np.resize(np.arange(251, dtype=np.uint8), chunk)  # no run of zeros a filesystem could elide
    path = os.path.join(workdir, "disk-probe")
    count = -(-nbytes // chunk)

    def write() -> None:
        with open(path, "wb", buffering=0) as fh:
            for _ in range(count):
                fh.write(memoryview(block))
            os.fsync(fh.fileno())

    def read() -> None:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(memoryview(block)):
                pass

    write_s = timed(write)
    drop_cache(path)
    read_s = timed(read)
    os.unlink(path)
    return write_s, read_s


def lines(device: str, quick: bool, workdir: str) -> Iterator[Line]:
    import warnings

    # one process, no process group: DCP says so on every call
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    from dtrain.training import CheckpointManager
    from dtrain.training.dcp import ModelState

    model, optimizer, step = build(device, quick)
    nbytes = state_bytes(model, optimizer)
    size = f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 4 else f"{nbytes / (1 << 20):.1f} MiB"
    copy_s = copy_floor(device, nbytes)
    yield Line("checkpoint: device-to-host copy (pinned)",
               f"{size} in {copy_s:.3f} s = {gib_s(nbytes, copy_s)} [{device}]")
    write_s, read_s = disk_limits(workdir, nbytes)
    yield Line("checkpoint: disk write+fsync", f"{size} in {write_s:.2f} s = {gib_s(nbytes, write_s)}")
    yield Line("checkpoint: disk read (cold)", f"{size} in {read_s:.2f} s = {gib_s(nbytes, read_s)}")

    # torch.save: one file from rank 0, fsynced (the second save: its host buffers exist)
    torch_ckpt = CheckpointManager(os.path.join(workdir, "torch"), every_n_steps=1, keep=1)
    whole = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch_ckpt.save(1, whole)
    torch_s = timed(lambda: torch_ckpt.save(2, whole))
    yield Line("checkpoint: torch.save, fsynced", f"{torch_s:.2f} s = {gib_s(nbytes, torch_s)}, "
               f"{write_s / torch_s:.2f} of the disk's write+fsync ({gib_s(nbytes, write_s)})")
    del torch_ckpt, whole
    shutil.rmtree(os.path.join(workdir, "torch"), ignore_errors=True)

    # DCP synchronous save and load (the second save is timed: the first allocates the host buffers)
    state = {"app": ModelState(model, optimizer)}
    sync_ckpt = CheckpointManager(workdir, every_n_steps=1, keep=1, format="dcp")
    first_sync_s = timed(lambda: sync_ckpt.save(1, state))
    sync_s = timed(lambda: sync_ckpt.save(2, state))
    share = write_s / sync_s
    yield Line("checkpoint: DCP synchronous save",
               f"{sync_s:.2f} s = {gib_s(nbytes, sync_s)}, {share:.2f} of the disk's write+fsync "
               f"({gib_s(nbytes, write_s)}; goal >= {DISK_SHARE}); first save {first_sync_s:.2f} s",
               judged(share >= DISK_SHARE, quick))
    drop_cache(sync_ckpt.latest_path())
    load_s = timed(lambda: sync_ckpt.load_latest(into=state))
    sync(device)
    share = read_s / load_s
    yield Line("checkpoint: DCP load", f"{load_s:.2f} s = {gib_s(nbytes, load_s)}, {share:.2f} of the disk's cold read "
               f"({gib_s(nbytes, read_s)}; goal >= {DISK_SHARE})", judged(share >= DISK_SHARE, quick))
    del sync_ckpt
    shutil.rmtree(os.path.join(workdir, "dcp"), ignore_errors=True)

    yield from async_lines(device, quick, workdir, state, step, copy_s, sync_s)


def async_lines(device: str, quick: bool, workdir: str, state: dict, step: Callable[[], None], copy_s: float,
                sync_s: float) -> Iterator[Line]:
    from dtrain.training import CheckpointManager

    steady_steps = 5 if quick else 30
    steady_s = timed(lambda: [step() for _ in range(steady_steps)])
    steady = steady_steps / steady_s
    ckpt = CheckpointManager(workdir, every_n_steps=1, keep=2, format="dcp", async_save=True)
    stalls, committed, rates = [], [], []
    for save in range(1, SAVES + 1):
        for _ in range(3):
            step()  # the parameters change between saves
        started = time.perf_counter()
        ckpt.save(save, state)
        stalls.append(time.perf_counter() - started)
        steps, writing_from = 0, time.perf_counter()
        while ckpt.save_in_flight():
            step()
            steps += 1
        committed.append(time.perf_counter() - started)
        ckpt.wait()
        if steps:
            rates.append(steps / (time.perf_counter() - writing_from))
    later = slice(1, None)  # the first save allocates and pins the host buffers
    stall = max(stalls[later])
    yield Line(f"checkpoint: DCP async stall, saves 2-{SAVES}",
               f"worst {stall:.3f} s, {stall / copy_s:.2f}x the pinned copy {copy_s:.3f} s (goal <= {STALL_VS_COPY}x); "
               f"first save {stalls[0]:.2f} s", judged(stall <= STALL_VS_COPY * copy_s, quick))
    worst = max(committed[later])
    yield Line(f"checkpoint: DCP async committed, saves 2-{SAVES}",
               f"worst {worst:.2f} s, {worst / sync_s:.2f}x the synchronous save {sync_s:.2f} s (goal <= 1.0x)",
               judged(worst <= sync_s, quick))
    if rates:
        rate = min(rates)
        yield Line("checkpoint: training steps during the async write",
                   f"{rate:.1f} steps/s, {rate / steady:.3f} of the steady {steady:.1f} steps/s "
                   f"(goal >= {RATE_SHARE}; worst of {len(rates)} saves)", judged(rate >= RATE_SHARE * steady, quick))
    else:
        yield Line("checkpoint: training steps during the async write", "no step fit in a write", judged(False, quick))


def main(argv: list[str] | None = None) -> int:
    return part_main(lines, argv)


if __name__ == "__main__":
    sys.exit(main())
