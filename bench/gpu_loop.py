"""The training loop against a bare loop of the same steps: ``TrainLoop`` with a loss read every step
(``loss.item()``, the float contract) and with a tensor loss (read in chunks once the device has passed
them), as tokens per second against the ceiling.

The ceiling is the same steps of the text example's ``CausalLM`` (bf16 autocast, fused AdamW) over the
same blocks, already on the device, in a plain ``for`` loop with no metrics; the ``TrainLoop`` runs
iterate the same blocks and write every step's metrics line to a run directory in the scratch folder
(no checkpoint: the interval is beyond the run). Each variant runs twice, interleaved; the faster run
counts. Small model: width 128, 2 layers, batch 256; medium: width 512, 6 layers, batch 64. The goal:
the tensor loss at 0.98 of the ceiling or more on the small model.

    python bench/gpu_loop.py [--device cuda|cpu] [--quick]

``--quick`` runs a tiny model for a few steps on the CPU, judging no goal: the suite runs it so that
the bench cannot rot.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import Line, ModelSize, judged, part_main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "text"))
sys.path.insert(0, os.path.join(ROOT, "operators"))

#: the tensor loss's share of the ceiling on the small model
GOAL = 0.98
BLOCK = 64  # tokens a block, as the text example packs them


@dataclass(frozen=True)
class Size(ModelSize):
    steps: int = 0
    goal: float | None = None  # judged on this size, or None


def sizes(quick: bool) -> list[Size]:
    if quick:
        return [Size("tiny", 16, 1, 4, 3, GOAL)]
    return [Size("small", 128, 2, 256, 400, GOAL), Size("medium", 512, 6, 64, 300, None)]


class Blocks:
    """The run's batches, already on the device: a loader TrainLoop takes (len, iter), with a sampler."""

    def __init__(self, batches: list):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)

    def set_epoch(self, epoch: int) -> None:  # the sampler's part: the order is fixed
        pass


def _setup(size: Size, device: str):
    import torch

    from text_pipeline.model import CausalLM, next_token_loss
    from text_pipeline.tokenizer import VOCAB_SIZE

    torch.manual_seed(0)
    model = CausalLM(VOCAB_SIZE, BLOCK, width=size.width, heads=4, layers=size.layers).to(device)
    cuda = device.startswith("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if cuda else {}))
    generator = torch.Generator().manual_seed(1)
    blocks = Blocks([torch.randint(0, VOCAB_SIZE, (size.batch, BLOCK), generator=generator).to(device)
                     for _ in range(size.steps)])

    def step(batch):
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss = next_token_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return model, optimizer, blocks, step


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(run: Callable[[], None], device: str) -> float:
    _sync(device)
    started = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - started


def _bare(step, blocks: Blocks) -> Callable[[], None]:
    def run() -> None:
        for batch in blocks:
            step(batch)
    return run


def _in_loop(model, optimizer, step, blocks: Blocks, run_dir: str, read_every_step: bool) -> Callable[[], None]:
    from dtrain.training.loop import TrainLoop
    from dtrain.training.preemption import PreemptionGuard

    def train_step(batch):
        loss = step(batch)
        return (loss.item() if read_every_step else loss), len(batch)

    def run() -> None:
        os.environ["DTRAIN_CHECKPOINT_DIR"] = os.path.join(run_dir, "checkpoints")
        os.environ["DTRAIN_METRICS_DIR"] = os.path.join(run_dir, "metrics")
        loop = TrainLoop(model, optimizer, rank=0, checkpoint_every=10 * len(blocks) + 1,
                         guard=PreemptionGuard(install=False))
        loop.run(blocks, blocks, 1, train_step)
    return run


def size_lines(size: Size, device: str, quick: bool, workdir: str) -> Iterator[Line]:
    model, optimizer, blocks, step = _setup(size, device)
    variants = {
        "ceiling": _bare(step, blocks),
        "float loss": _in_loop(model, optimizer, step, blocks, os.path.join(workdir, f"{size.name}-float"), True),
        "tensor loss": _in_loop(model, optimizer, step, blocks, os.path.join(workdir, f"{size.name}-tensor"), False),
    }
    for batch in blocks.batches[:2 if quick else 20]:  # warm up: kernels chosen, allocator filled
        step(batch)
    best = {name: float("inf") for name in variants}
    for _ in range(2):
        for name, run in variants.items():
            best[name] = min(best[name], _timed(run, device))
    tokens = size.batch * (BLOCK - 1) * size.steps
    ceiling = tokens / best["ceiling"]
    label = f"{size.name} (width {size.width}, {size.layers} layers, batch {size.batch})"
    yield Line(f"loop: ceiling, {label}", f"{ceiling:,.0f} tokens/s ({1000 * best['ceiling'] / size.steps:.2f} ms/step)")
    for name in ("float loss", "tensor loss"):
        rate = tokens / best[name]
        goal = size.goal if name == "tensor loss" else None
        ok = judged(rate / ceiling >= goal, quick) if goal is not None else None
        bar = f", goal >= {goal}" if goal is not None else ""
        yield Line(f"loop: TrainLoop {name}, {label}",
                   f"{rate:,.0f} vs ceiling {ceiling:,.0f} tokens/s = {rate / ceiling:.3f}{bar}", ok)


def lines(device: str, quick: bool, workdir: str) -> Iterator[Line]:
    for size in sizes(quick):
        yield from size_lines(size, device, quick, workdir)


def main(argv: list[str] | None = None) -> int:
    return part_main(lines, argv)


if __name__ == "__main__":
    sys.exit(main())
