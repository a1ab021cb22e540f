"""The Slurm options of ``dtrain launch``: ``--partition``, ``--time``, ``--account``,
``--sbatch-option``, ``--slurm-poll-interval`` and ``--slurm-lost-after``.

The generic launch CLI asks every registered backend for its options; these become the
spec's ``backend_options`` (validated by :class:`~.render.SlurmOptions`) with ``--backend slurm``.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("slurm backend (--backend slurm)")
    g.add_argument("--partition", help="Slurm partition (-p); default: the cluster's default partition")
    g.add_argument("--time", help="time limit in Slurm's format (90, 1:30:00, 2-00:00:00)")
    g.add_argument("--account", help="Slurm account to charge")
    g.add_argument("--sbatch-option", action="append", default=None, metavar="--OPT[=VALUE]",
                   help="an extra sbatch option such as --qos=high or --exclusive (repeatable)")
    g.add_argument("--slurm-poll-interval", type=float, default=None, help="seconds between job state polls")
    g.add_argument("--slurm-lost-after", type=float, default=None,
                   help="seconds (>= 10; default 30) after which a node cut off from its peer fences itself "
                        "and a silent node counts as lost")


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    options = {"partition": args.partition, "time_limit": args.time, "account": args.account,
               "extra_sbatch": args.sbatch_option, "poll_interval": args.slurm_poll_interval,
               "lost_after": args.slurm_lost_after}
    return {k: v for k, v in options.items() if v is not None}
