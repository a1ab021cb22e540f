"""``dtrain launch`` options of the SSH backend (``--hostfile``, ``--ssh-*``).

The generic launch CLI asks every registered backend for its options; these become the
spec's ``backend_options`` (validated there) when ``--backend ssh`` is chosen. The flags are
those of :data:`~dtrain.launch.backends.ssh.hostfile.SSH_OPTIONS`.
"""

from __future__ import annotations

import argparse
from typing import Any

from dtrain.launch.backends.ssh.hostfile import SSH_OPTIONS


def add_arguments(p: argparse.ArgumentParser) -> None:
    SSH_OPTIONS.add_arguments(p, defaults=False)  # unset flags stay None: the options' defaults apply later


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in SSH_OPTIONS.from_args(args).items() if v is not None}
