"""A DDP job for the straggler tests and bench: every step computes a small MLP on a fixed random batch
(CPU-bound, so a host with a throttled CPU computes slower) and all-reduces its gradients (DDP), with the
training helper's metrics and collective timer (dtrain.training.collectives), as a user's script would.

    straggler_train.py [--steps N] [--width W] [--batch B]

Runs ``--steps`` steps (default: until stopped). The tests and bench/faults.py stop it once they have
what they measure.
"""

from __future__ import annotations

import argparse
import time

import torch

from dtrain.training.dist import exit_now, init_distributed, shutdown
from dtrain.training.metrics import MetricsWriter

try:
    from dtrain.training.collectives import CollectiveTimer
except ImportError:  # an older checkout, which bench/faults.py --previous runs this on too, has no timer
    CollectiveTimer = None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--width", type=int, default=384, help="width of the MLP's 3 layers (compute and gradient size)")
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args()
    ctx = init_distributed()
    # One compute thread, as one rank per core: with torch's default (a thread per core) two ranks on this
    # machine's 2 shared cores spun in OpenMP barriers whenever other work ran, and a step's compute
    # jumped between 0.02 s and 1 s on a healthy host, hiding what the tests and bench slow down.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    timer = CollectiveTimer.of(model) if CollectiveTimer else None
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    metrics = MetricsWriter(ctx.rank)
    x = torch.randn(args.batch, args.width)
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        loss = model(x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        metrics.log(step=step, loss=loss.item(), samples=args.batch, step_time_s=time.perf_counter() - started,
                    data_wait_s=0.0, **({"comm_wait_s": timer.take()} if timer else {}))
    metrics.close()
    shutdown()
    return 0


if __name__ == "__main__":
    exit_now(main())
