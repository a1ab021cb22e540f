"""Where a job's ranks go: :class:`Placement`, a plain typed value, and :data:`PLACEMENT_TABLE`, its options.

A placement is nodes x procs_per_node on a backend, with that backend's options and the device. It is
built checked by the registry (:func:`dtrain.launch.backends.resolve_placement`), which keeps what the
backend resolved from its options, typed, in :attr:`Placement.resolved` (the ssh backend's host
entries and settings, Slurm's ``SlurmOptions``); everything after reads that value, never the options
again. A :class:`~dtrain.launch.core.spec.LaunchSpec` is a job on a placement; preflight and autotuning
need only the placement, so they never build a spec.

Below the job model, beside the backend contract: the registry resolves a placement against a
backend's class, and the contract's methods take one. Imports neither Airflow nor torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from dtrain.options import Option, Options, integer

__all__ = ["DEVICES", "PLACEMENT_TABLE", "Placement", "visible_gpu_count"]

DEVICES = ("auto", "cpu", "gpu")

#: the placement's options, declared once: the job's table
#: (:data:`~dtrain.launch.core.spec_options.JOB_OPTIONS`) holds these rows, and the registry checks with them
PLACEMENT_TABLE = Options([
    Option("nodes", int | str, 1, "number of nodes (default 1), or MIN:MAX for an elastic job (goes on with at "
                                  "least MIN nodes when some are lost; local, ssh, slurm)", templated=True),
    Option("procs_per_node", int, 1, "processes per node (default 1)", templated=True, check=integer(1, 1024)),
    Option("backend", str, "local", "one of {backends} (default local)", templated=True),
    Option("device", str, "auto", choices=DEVICES),
    Option("gpus_per_node", int, None, "GPUs per node (default: this host's, for backends running here)",
           check=integer(minimum=0)),
    Option("backend_options", dict, {}, "the backend's own options (the tables below; an operator's: one section per "
                                        "backend, the chosen one's used); on the CLI, the backend's flags",
           templated=True, flag=None, operator_default=None),
])


def visible_gpu_count() -> int:
    """GPUs on this host, without importing torch: the NVIDIA driver's /proc entries,
    narrowed by CUDA_VISIBLE_DEVICES as CUDA would."""
    try:
        count = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        count = min(count, len(ids))
    return count


@dataclass(frozen=True)
class Placement:
    """``nodes`` x ``procs_per_node`` ranks on ``backend``, as the registry resolved them.

    Args:
        nodes: number of nodes (simulated nodes for a single-host backend); an elastic job's MAX.
        procs_per_node: processes per node (GPUs per node on GPU hosts).
        backend: a registered backend's name.
        options: that backend's own options, as given (its section of an operator's ``backend_options``,
            completed where the task runs; a launch's ``backend_options``).
        device: ``auto`` (GPU if the host has one), ``cpu`` or ``gpu``.
        gpus_per_node: GPUs each node has; None counts this host's (single-host backends).
        min_nodes: an elastic job's MIN (it starts on up to ``nodes`` and goes on while MIN are left);
            None: a fixed number of nodes.
        resolved: what the backend resolved from ``options`` (:meth:`Backend.resolve_placement`), typed.
    """

    nodes: int = 1
    procs_per_node: int = 1
    backend: str = "local"
    options: Mapping[str, Any] = field(default_factory=dict)
    device: str = "auto"
    gpus_per_node: int | None = None
    min_nodes: int | None = None
    resolved: Any = field(default=None, repr=False, compare=False)

    @property
    def elastic(self) -> bool:
        """Whether the job goes on with fewer nodes than it started on (``nodes="MIN:MAX"``)."""
        return self.min_nodes is not None

    @property
    def nnodes(self) -> str:
        """The nodes as torchrun's ``--nnodes`` takes them: ``N``, or ``MIN:MAX``."""
        return f"{self.min_nodes}:{self.nodes}" if self.elastic else str(self.nodes)

    @property
    def world_size(self) -> int:
        """Ranks on all nodes; an elastic job's at its most (MAX nodes)."""
        return self.nodes * self.procs_per_node

    def gpu_capacity(self) -> int:
        return visible_gpu_count() if self.gpus_per_node is None else self.gpus_per_node

    def uses_gpu(self) -> bool:
        if self.device == "cpu":
            return False
        if self.device == "gpu":
            return True
        return self.gpu_capacity() > 0
