"""A small real DDP job over gloo: fit y = 3x - 1 with a 1-parameter-pair model.

Every rank trains on its own shard of synthetic data with DistributedDataParallel
(so gradients are all-reduced across nodes) and writes a report with its env
(RANK, NODE_RANK, SLURM_NODEID...), its final parameters, loss and argv.

    ddp_report.py REPORT_DIR [--steps N] [--sleep S [--until-file FILE]] [--fail-rank R] [ARGS...]

--sleep keeps the job alive (to cancel it); with --until-file it ends its sleep as soon as
FILE exists (S is then only the most it sleeps: a test releases the job once it has seen
what had to happen while the job ran). --fail-rank R exits 7 on rank R after printing a
marker line, to test failure reporting.
"""

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("report_dir")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--until-file", default="")
    parser.add_argument("--fail-rank", type=int, default=-1)
    args, extra = parser.parse_known_args()

    rank = int(os.environ["RANK"])
    if args.sleep:
        print(f"rank {rank} sleeping {args.sleep}s pid={os.getpid()}", flush=True)
        deadline = time.monotonic() + args.sleep
        while time.monotonic() < deadline and not (args.until_file and os.path.exists(args.until_file)):
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    if rank == args.fail_rank:
        print(f"rank {rank}: deliberate failure marker", flush=True)
        return 7

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(rank)
    x = torch.rand(64, 1)
    y = 3 * x - 1
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    first = last = None
    for _ in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
    weight = model.module.weight.item()
    bias = model.module.bias.item()
    dist.barrier()
    dist.destroy_process_group()
    report = {
        "argv": extra,
        "first_loss": first, "last_loss": last, "weight": weight, "bias": bias,
        "pid": os.getpid(), "host": os.uname().nodename,
        **{k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                                          "GROUP_RANK", "SLURM_NODEID", "SLURM_JOB_ID", "MASTER_ADDR",
                                          "MASTER_PORT", "DTRAIN_RUN_DIR", "HOSTILE", "SLURMD_NODENAME",
                                          "GLOO_SOCKET_IFNAME")},
    }
    os.makedirs(args.report_dir, exist_ok=True)
    path = os.path.join(args.report_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(report, fh)
    os.replace(path + ".tmp", path)
    print(f"rank {rank} node {os.environ.get('NODE_RANK')} slurm node {os.environ.get('SLURM_NODEID')}: "
          f"loss {first:.4f} -> {last:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
