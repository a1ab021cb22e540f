"""A tiny real DDP job (gloo) for the remote-backend tests.

Every rank writes ``reports/rank<R>.json`` under $DTRAIN_RUN_DIR: its env contract,
argv, host, pid, a start timestamp, its loss curve, a checksum of the gradients DDP
all-reduced (equal on every rank if the all-reduce happened) and of the final weights.

Options: --steps N, --fail-rank R (that rank exits 3 after the first step),
--hang (after training, every rank sleeps: for kill tests), --start-only (write the
start record and exit, 3 on --fail-rank: for the launch benchmark and cheap CLI checks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CONTRACT = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
            "GLOO_SOCKET_IFNAME")


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def tf_config() -> str | None:
    """This rank's TF_CONFIG: as set for it, else rendered from what the backend exported."""
    from dtrain.launch.node.tf_config import tf_config_env

    return os.environ.get("TF_CONFIG") or tf_config_env(os.environ).get("TF_CONFIG")


def main() -> int:
    started = time.time()
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--hang", action="store_true")
    p.add_argument("--start-only", action="store_true")
    p.add_argument("rest", nargs="*", help="ignored; recorded verbatim")
    args = p.parse_args()
    run_dir = os.environ["DTRAIN_RUN_DIR"]
    rank = int(os.environ["RANK"])
    report = {
        "env": {k: os.environ.get(k) for k in CONTRACT},
        "argv": sys.argv[1:], "host": os.uname().nodename, "pid": os.getpid(), "started": started,
        "node_index": os.environ.get("DTRAIN_NODE_INDEX"), "tf_config": tf_config(),
        "mpi_option": os.environ.get("TEST_MPI_OPTION"),
    }
    path = os.path.join(run_dir, "reports", f"rank{rank}.json")
    if args.start_only:
        write_json(path, report)
        return 3 if rank == args.fail_rank else 0

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data shard
    x = torch.randn(64, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True) * 0.5
    losses, grad_sums = [], []
    for step in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        grad_sums.append(float(sum(p.grad.double().sum() for p in model.parameters())))
        opt.step()
        # The mean loss over ranks: what the job as a whole optimises.
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        if step == 0 and rank == args.fail_rank:
            print(f"rank {rank} fails on purpose", flush=True)
            os._exit(3)
    report.update(losses=losses, grad_sums=grad_sums,
                  weights=float(sum(p.detach().double().sum() for p in model.parameters())))
    write_json(path, report)
    print(f"rank {rank} done: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    if args.hang:
        time.sleep(3600)
    return 0


if __name__ == "__main__":
    code = main()
    if "torch.distributed" not in sys.modules:  # --start-only: no torch to tear down (or import)
        sys.exit(code)
    from dtrain.training.dist import exit_now

    # Destroys the process group and skips the interpreter's teardown, in which gloo can abort
    # or stall a finished rank (see dtrain.training.dist.exit_now), as the reference script does.
    exit_now(code)
