"""What the parts of ``bench/gpu.py`` share: a result line with its goal, and the device to run on.

Each part (``gpu_checkpoint``, ``gpu_loop``, ``gpu_feed``) is a module with
``lines(device: str, quick: bool, workdir: str) -> Iterator[Line]`` and a ``main()`` that prints its
lines alone. ``quick`` shrinks every size so the part runs in seconds on a CPU (the suite runs it so),
where a figure means nothing and no goal is judged.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator


@dataclass(frozen=True)
class Line:
    """One printed figure against its limit or peer measured in the same run."""

    name: str                 # what was measured, e.g. "checkpoint: DCP async stall"
    text: str                 # both figures and their ratio
    ok: bool | None = None    # the goal met (True), missed (False), or no goal / not judged (None)

    def render(self) -> str:
        verdict = {True: "ok", False: "MISSED", None: "-"}[self.ok]
        return f"{self.name}: {self.text} [{verdict}]"


@dataclass(frozen=True)
class ModelSize:
    """The text example's CausalLM at one size, as the feed and loop parts train it."""

    name: str      # "small", "medium" (the sizes the goals name), "tiny" (quick runs)
    width: int
    layers: int
    batch: int


def judged(ok: bool, quick: bool) -> bool | None:
    """A goal is judged only on a real run: quick runs' figures are too small to mean anything."""
    return None if quick else ok


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def part_main(lines: Callable[[str, bool, str], Iterator[Line]], argv: list[str] | None = None) -> int:
    """The ``main()`` of one part: print its lines; exit 1 when a goal was missed."""
    import tempfile

    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run that judges no goal")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a new temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        return report(lines(args.device or default_device(), args.quick, workdir))


def report(results: Iterable[Line]) -> int:
    missed = 0
    for line in results:
        print(line.render(), flush=True)
        missed += line.ok is False
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit("run bench/gpu.py, or one part: bench/gpu_checkpoint.py, bench/gpu_loop.py, bench/gpu_feed.py")
