"""The Slurm options of ``dtrain launch``: ``--partition``, ``--time``, ``--account``,
``--sbatch-option``, ``--slurm-poll-interval`` and ``--slurm-lost-after``.

The generic launch CLI asks every registered backend for its options; these become the
spec's ``backend_options`` (validated by :class:`~.render.SlurmOptions`) with ``--backend slurm``.
The flags are those of :data:`~dtrain.launch.backends.slurm.render.SLURM_OPTIONS`.
"""

from __future__ import annotations

import argparse
from typing import Any

from dtrain.launch.backends.slurm.render import SLURM_OPTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    SLURM_OPTIONS.add_arguments(parser, defaults=False)  # unset flags stay None: the options' defaults apply later


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in SLURM_OPTIONS.from_args(args).items() if v is not None}
