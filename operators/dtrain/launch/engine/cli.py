"""``dtrain launch [options] -- CMD ARGS...``: run CMD on every rank, exit with the failing rank's status.

The job's options are the flags of :data:`~dtrain.launch.core.spec_options.JOB_OPTIONS`; every
registered backend adds its own group of options
(:meth:`~dtrain.launch.backends.Backend.add_cli_arguments`), and those of the chosen backend
become the spec's ``backend_options``. Options of another backend are refused.
"""

from __future__ import annotations

import argparse
import signal
import sys

from dtrain.launch.core.spec_options import JOB_OPTIONS


def register(subparsers) -> None:
    from dtrain.launch.backends import backend_names, get_backend_class

    p = subparsers.add_parser("launch", help="launch a distributed training command",
                              description="Run CMD (an argv list, no shell) on every rank.")
    JOB_OPTIONS.add_arguments(p, context={"backends": ", ".join(backend_names())})
    p.add_argument("--dry-run", action="store_true",
                   help="print what would run (the sbatch script, or one argv per started process) and start nothing")
    for name in backend_names():
        get_backend_class(name).add_cli_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p.set_defaults(func=run)


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
    spec = LaunchSpec(command=command, **JOB_OPTIONS.from_args(args), backend_options=backend_options(args))
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
