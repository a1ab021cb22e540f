"""The GPU path in one command: launches, the feed, the training loop and checkpoints on one GPU host.

    python bench/gpu.py                     # every part, about 5 minutes on one H200
    python bench/gpu.py --parts feed,loop   # some parts
    python bench/gpu.py --quick --device cpu  # a smoke run in tiny sizes, judging no goal

Needs PyTorch with CUDA (and DeepSpeed for its DeepSpeed line), not Airflow: it runs from a checkout
(``operators`` and ``examples/text`` go on the path). Every line prints a figure against its limit or
its peer measured in the same run, then ``[ok]``, ``[MISSED]`` or ``[-]`` (no goal); the exit status is
1 when any goal was missed. The parts:

* ``launch`` (bench/gpu_launch.py): ``dtrain launch`` of the text example, digits DDP and DeepSpeed;
* ``feed`` (bench/gpu_feed.py): the ceiling, ``ShardLoader`` and ``DataLoader`` feeding the text
  example's model, small and medium, quiet and with half the cores busy;
* ``loop`` (bench/gpu_loop.py): ``TrainLoop`` with a loss read every step against a tensor loss;
* ``checkpoint`` (bench/gpu_checkpoint.py): device-to-host and disk limits, ``torch.save``, DCP sync,
  DCP async over 5 saves.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import Line, default_device, report  # noqa: E402

PARTS = ("launch", "feed", "loop", "checkpoint")


def host_line(device: str) -> Line:
    import torch

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpus = f"{torch.cuda.device_count()} x {props.name} ({props.total_memory / 2**30:.0f} GiB)"
        cuda = f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
    else:
        gpus, cuda = "no GPU", "CPU"
    return Line("host", f"{gpus}, {os.cpu_count()} cores, torch {torch.__version__}, {cuda}, "
                        f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")


def part_lines(part: str, device: str, quick: bool, workdir: str) -> Iterator[Line]:
    """One part's lines, then its time; a part that raises is a missed goal with its error, and the
    next part still runs."""
    started = time.monotonic()
    try:
        module = importlib.import_module(f"gpu_{part}")
        yield from module.lines(device, quick, os.path.join(workdir, part))
    except Exception as e:  # noqa: BLE001 (reported as the part's failure; the other parts go on)
        traceback.print_exc()
        yield Line(f"{part}: error", f"{type(e).__name__}: {e}", False)
    yield Line(f"{part}: took", f"{time.monotonic() - started:.1f} s")


def parse_parts(text: str) -> list[str]:
    parts = [p for p in text.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"bench/gpu.py: --parts={text!r}: allowed are comma-separated names of {', '.join(PARTS)}")
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when there is one")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run that judges no goal")
    parser.add_argument("--workdir", default=None, help="scratch folder on the disk to measure (default: a new temporary one)")
    args = parser.parse_args(argv)
    parts = parse_parts(args.parts)
    device = args.device or default_device()
    with tempfile.TemporaryDirectory(prefix="dtrain-gpu-bench-", dir=args.workdir) as workdir:
        for part in parts:
            os.makedirs(os.path.join(workdir, part))

        def every_line() -> Iterator[Line]:
            yield host_line(device)
            for part in parts:
                yield from part_lines(part, device, args.quick, workdir)

        return report(every_line())


if __name__ == "__main__":
    sys.exit(main())
