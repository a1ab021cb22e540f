"""The Slurm options of ``dtrain launch``: ``--partition``, ``--time``, ``--account``,
``--gpus-per-node``, ``--sbatch-option`` and ``--dry-run`` (print the sbatch script, submit nothing).

Kept out of the generic launch CLI so that module only gains two calls; nothing here is
imported beyond argparse until a launch actually uses Slurm.
"""

from __future__ import annotations

import argparse
import sys

SLURM_ONLY = ("partition", "time", "account", "sbatch_option", "dry_run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slurm backend (--backend slurm)")
    g.add_argument("--partition", help="Slurm partition (-p); default: the cluster's default partition")
    g.add_argument("--time", help="time limit in Slurm's format (90, 1:30:00, 2-00:00:00)")
    g.add_argument("--account", help="Slurm account to charge")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node (requested from Slurm as --gpus-per-node; also the local capacity check)")
    g.add_argument("--sbatch-option", action="append", default=[], metavar="--OPT[=VALUE]",
                   help="an extra sbatch option such as --qos=high or --exclusive (repeatable)")
    g.add_argument("--slurm-poll-interval", type=float, default=2.0, help="seconds between job state polls")
    g.add_argument("--dry-run", action="store_true",
                   help="print the rendered sbatch script (also written to the run directory) and submit nothing")


def check_backend(args: argparse.Namespace) -> None:
    """Slurm-only options with another backend are a mistake, not something to ignore silently."""
    if args.backend == "slurm":
        return
    from operators.errors import SpecError

    for name in SLURM_ONLY:
        value = getattr(args, name, None)
        if value:
            raise SpecError(f"--{name.replace('_', '-')}", value, "only with --backend slurm")


def options_from_args(args: argparse.Namespace):
    from operators.launch.backends.slurm import SlurmOptions

    return SlurmOptions(partition=args.partition, time_limit=args.time, account=args.account,
                        extra_sbatch=tuple(args.sbatch_option), poll_interval=args.slurm_poll_interval)


def backend_from_args(args: argparse.Namespace):
    """The Slurm backend configured from the command line (validated before anything is submitted)."""
    from operators.launch.backends.slurm import SlurmBackend

    return SlurmBackend(options=options_from_args(args))


def dry_run(spec, args: argparse.Namespace) -> int:
    """Render the job's sbatch script, print it, write it to the run directory; submit nothing."""
    from operators.launch.backends.slurm import render_sbatch, write_script
    from operators.launch.job import prepare_job

    options = options_from_args(args)
    job = prepare_job(spec)
    path = write_script(job, options)
    sys.stdout.write(render_sbatch(job, options))
    print(f"[dtrain] dry run: nothing submitted; submit it yourself with: sbatch {path}", file=sys.stderr)
    return 0
