"""``dtrain launch [options] -- CMD ARGS...``: run CMD on every rank, exit with the failing rank's status.

The generic options are here; every registered backend adds its own group of options
(:meth:`~dtrain.launch.backends.Backend.add_cli_arguments`), and those of the chosen
backend become the spec's ``backend_options``. Options of another backend are refused.
"""

from __future__ import annotations

import argparse
import signal
import sys

from dtrain.launch.core.spec import DISTRIBUTIONS


def register(subparsers) -> None:
    from dtrain.launch.backends import backend_names, get_backend_class

    p = subparsers.add_parser("launch", help="launch a distributed training command",
                              description="Run CMD (an argv list, no shell) on every rank.")
    p.add_argument("--nodes", default="1", help="number of nodes (default 1), or MIN:MAX for an elastic job "
                                                "(goes on with at least MIN nodes when some are lost; local, ssh, slurm)")
    p.add_argument("--procs-per-node", type=int, default=1, help="processes per node (default 1)")
    p.add_argument("--distribution", default="pytorch", choices=DISTRIBUTIONS)
    p.add_argument("--backend", default="local", help=f"one of {', '.join(backend_names())} (default local)")
    p.add_argument("--deepspeed-config", metavar="FILE", help="DeepSpeed JSON config (validated before launch)")
    p.add_argument("--model-parallel-size", type=int, default=1,
                   help="distribution deepspeed: tensor-parallel size the script uses (DeepSpeed's batch arithmetic "
                        "counts data-parallel ranks: world size / (model x pipeline parallel))")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="distribution deepspeed: pipeline stages the script uses")
    p.add_argument("--pass-local-rank", action="store_true",
                   help="append --local_rank=N to every rank's command, as the deepspeed launcher does")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun worker restarts after a failure")
    p.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS",
                   help="declare the job hung when a rank shows no progress (a printed line, a metrics record, "
                        "a heartbeat) for SECONDS: dump every rank's stack, stop the job, exit 124 (default: off)")
    p.add_argument("--stop-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on a stop (SIGTERM, a preemption), seconds every rank has to save a checkpoint and exit "
                        "before it is killed (default 30)")
    p.add_argument("--rdzv-port", type=int, default=0, help="rendezvous port (default: a free port per job)")
    p.add_argument("--rdzv-timeout", type=float, default=300.0, help="seconds for all nodes to join")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"))
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node (default: this host's, for backends running here)")
    p.add_argument("--run-dir", help="checkpoints, metrics and exit records (reuse it to resume)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra env for every rank")
    p.add_argument("--mpi-option", action="append", metavar="OPT", dest="mpi_options",
                   help="distribution mpi: extra mpirun option(s), repeatable; --mpi-option='-x NCCL_DEBUG=VERSION'")
    p.add_argument("--parameter-servers", type=int, default=0,
                   help="distribution tensorflow: ranks that are TF_CONFIG 'ps' tasks (legacy TF 1.x)")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would run (the sbatch script, or one argv per started process) and start nothing")
    for name in backend_names():
        get_backend_class(name).add_cli_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.set_defaults(func=run)


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            from dtrain.errors import SpecError
            raise SpecError("--env", item, "KEY=VALUE")
        env[key] = value
    return env


def backend_options(args: argparse.Namespace) -> dict:
    """The chosen backend's options from the command line; another backend's options are a mistake."""
    from dtrain.errors import SpecError
    from dtrain.launch.backends import backend_names, get_backend_class

    chosen = get_backend_class(args.backend)
    for name in backend_names():
        if name != chosen.name:
            stray = get_backend_class(name).options_from_cli(args)
            unused = sorted(set(stray) - set(chosen.options_from_cli(args)))
            if unused:
                raise SpecError(f"--{unused[0].replace('_', '-')}", stray[unused[0]], f"only with --backend {name}")
    return chosen.options_from_cli(args)


def run(args: argparse.Namespace) -> int:
    from dtrain.launch.engine.launcher import Launcher
    from dtrain.launch.core.spec import LaunchSpec

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    spec = LaunchSpec(
        command=command, nodes=args.nodes, procs_per_node=args.procs_per_node,
        distribution=args.distribution, backend=args.backend, deepspeed_config=args.deepspeed_config,
        max_restarts=args.max_restarts, rdzv_port=args.rdzv_port, rdzv_timeout=args.rdzv_timeout,
        device=args.device, run_dir=args.run_dir, env=parse_env(args.env), gpus_per_node=args.gpus_per_node,
        mpi_options=args.mpi_options, parameter_servers=args.parameter_servers, backend_options=backend_options(args),
        hang_timeout=args.hang_timeout, stop_grace=args.stop_grace, model_parallel_size=args.model_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, pass_local_rank=args.pass_local_rank,
    )
    if args.dry_run:
        return dry_run(spec)
    launcher = Launcher(spec)

    def on_signal(signum, _frame):
        print(f"[dtrain] received signal {signum}: stopping every rank", file=sys.stderr, flush=True)
        launcher.terminate()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    result = launcher.run()
    if result.hang:
        print(f"[dtrain] {result.hang['message']}", file=sys.stderr)
    if result.lost:
        print(f"[dtrain] {result.lost['message']}", file=sys.stderr)
    if not result.ok and result.tail:
        source = f"rank {result.failed_rank}" if result.failed_rank is not None else f"node {result.failed_node}"
        print(f"[dtrain] last lines of {source}:", file=sys.stderr)
        for line in result.tail[-20:]:
            print(f"    {line}", file=sys.stderr)
    return result.exit_code


def dry_run(spec) -> int:
    """Print what the backend would run (its dry-run request); start and write nothing."""
    from dtrain.launch.backends import backend_for
    from dtrain.launch.core.job import prepare_job

    backend = backend_for(spec)(sink=lambda line: print(line, file=sys.stderr))
    request = backend.dryrun(prepare_job(spec, create=False))
    sys.stdout.write(request.render())
    print(f"[dtrain] dry run: backend {request.backend}; nothing was started or written", file=sys.stderr)
    return 0
