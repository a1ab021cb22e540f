"""``dtrain launch [options] -- CMD ARGS...``: run CMD on every rank, exit with the failing rank's status."""

from __future__ import annotations

import argparse
import signal
import sys

from operators.launch import remote_cli, slurm_cli
from operators.launch.spec import BACKENDS, DISTRIBUTIONS


def register(subparsers) -> None:
    p = subparsers.add_parser("launch", help="launch a distributed training command",
                              description="Run CMD (an argv list, no shell) on every rank.")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--procs-per-node", type=int, default=1, help="processes per node (default 1)")
    p.add_argument("--distribution", default="pytorch", choices=DISTRIBUTIONS)
    p.add_argument("--backend", default="local", choices=BACKENDS)
    p.add_argument("--deepspeed-config", metavar="FILE", help="DeepSpeed JSON config (validated before launch)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun worker restarts after a failure")
    p.add_argument("--rdzv-port", type=int, default=0, help="rendezvous port (default: a free port per job)")
    p.add_argument("--rdzv-timeout", type=float, default=300.0, help="seconds for all nodes to join")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"))
    p.add_argument("--run-dir", help="checkpoints, metrics and exit records (reuse it to resume)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra env for every rank")
    slurm_cli.add_arguments(p)
    remote_cli.add_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.set_defaults(func=run)


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            from operators.errors import SpecError
            raise SpecError("--env", item, "KEY=VALUE")
        env[key] = value
    return env


def run(args: argparse.Namespace) -> int:
    from operators.launch.launcher import Launcher
    from operators.launch.spec import LaunchSpec

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    slurm_cli.check_backend(args)
    spec = LaunchSpec(
        command=command, nodes=args.nodes, procs_per_node=args.procs_per_node,
        distribution=args.distribution, backend=args.backend, deepspeed_config=args.deepspeed_config,
        max_restarts=args.max_restarts, rdzv_port=args.rdzv_port, rdzv_timeout=args.rdzv_timeout,
        device=args.device, run_dir=args.run_dir, env=parse_env(args.env), gpus_per_node=args.gpus_per_node,
        **remote_cli.spec_kwargs(args),
    )
    if args.dry_run:
        return slurm_cli.dry_run(spec, args)
    launcher = Launcher(spec, backend=slurm_cli.backend_from_args(args) if args.backend == "slurm" else None)

    def on_signal(signum, _frame):
        print(f"[dtrain] received signal {signum}: stopping every rank", file=sys.stderr, flush=True)
        launcher.terminate()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    result = launcher.run()
    if not result.ok and result.tail:
        print(f"[dtrain] last lines of rank {result.failed_rank}:", file=sys.stderr)
        for line in result.tail[-20:]:
            print(f"    {line}", file=sys.stderr)
    return result.exit_code
