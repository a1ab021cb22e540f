"""Where a job's ranks go, resolved once: :class:`Placement`.

A placement is nodes x procs_per_node on a backend, with that backend's options and the device.
Building one checks all of it (a :class:`SpecError` naming field, value and what is allowed) and
keeps what the backend resolved from its options, typed, in :attr:`Placement.resolved` (the ssh
backend's host entries and settings, Slurm's :class:`SlurmOptions`); everything after reads that
value, never the options again. A :class:`~dtrain.launch.core.spec.LaunchSpec` is a job on a placement;
preflight and autotuning need only the placement, so they never build a spec. The operators that
place work take their placement arguments through :class:`dtrain.launch.airflow.placement_args.PlacementArgs`.

Imports neither Airflow nor torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from dtrain import grammar
from dtrain.args import coerce_int, mapping_arg, node_range
from dtrain.errors import SpecError
from dtrain.launch.core.spec_options import DEVICES, JOB_OPTIONS

__all__ = ["DEVICES", "Placement", "visible_gpu_count"]


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
    """``nodes`` x ``procs_per_node`` ranks on ``backend``, checked when built.

    Args:
        nodes: number of nodes (simulated nodes for a single-host backend), or ``"MIN:MAX"`` for an
            elastic job (on a backend with ``supports_elastic``): it starts on up to MAX nodes and
            goes on while at least MIN are left (:attr:`nodes` is then MAX, :attr:`min_nodes` MIN).
        procs_per_node: processes per node (GPUs per node on GPU hosts).
        backend: a registered backend's name.
        options: that backend's own options (its section of an operator's ``backend_options``,
            completed by :meth:`for_operator`; a launch's ``backend_options``).
        device: ``auto`` (GPU if the host has one), ``cpu`` or ``gpu``.
        gpus_per_node: GPUs each node has; None counts this host's (single-host backends).
    """

    nodes: int = 1
    procs_per_node: int = 1
    backend: str = "local"
    options: Mapping[str, Any] = field(default_factory=dict)
    device: str = "auto"
    gpus_per_node: int | None = None
    #: an elastic job's MIN (None: a fixed number of nodes); from ``nodes="MIN:MAX"``
    min_nodes: int | None = None
    #: what the backend resolved from ``options`` (:meth:`Backend.resolve_placement`), typed
    resolved: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from dtrain.launch.backends import get_backend_class

        set_ = object.__setattr__  # frozen: each field is converted once, here
        set_(self, "backend", str(self.backend).strip().lower())
        backend_cls = get_backend_class(self.backend)  # SpecError naming the installed ones
        self._set_nodes(backend_cls)
        set_(self, "procs_per_node", JOB_OPTIONS.check("procs_per_node", self.procs_per_node))
        set_(self, "options", dict(mapping_arg("backend_options", self.options,
                                               not_json="a mapping (or a JSON object string)",
                                               not_mapping="a mapping of the backend's options")))
        set_(self, "device", JOB_OPTIONS.check("device", self.device))
        set_(self, "gpus_per_node", JOB_OPTIONS.check("gpus_per_node", self.gpus_per_node))
        self._check_gpus(backend_cls.single_host)
        set_(self, "resolved", backend_cls.resolve_placement(self))

    @classmethod
    def for_operator(cls, *, nodes: Any, procs_per_node: Any, backend: Any, backend_options: Any,
                     device: Any = "auto", gpus_per_node: Any = None) -> "Placement":
        """An operator's placement: ``backend_options`` is ``{backend name: options}``; the chosen
        backend's section is completed where the task runs (e.g. from an Airflow connection)."""
        from dtrain.launch.backends import options_for

        name = str(backend).strip().lower()
        return cls(nodes=nodes, procs_per_node=procs_per_node, backend=name,
                   options=options_for(name, backend_options), device=device, gpus_per_node=gpus_per_node)

    def _set_nodes(self, backend_cls: Any) -> None:
        """``nodes``: a count, or ``MIN:MAX`` (also given as ``min_nodes`` and ``nodes``); MIN equal to
        MAX is a fixed count."""
        least, nodes = node_range("nodes", self.nodes, maximum=grammar.MAX_NODES)
        if self.min_nodes is not None:
            if least != nodes:
                raise SpecError("nodes", self.nodes, "MIN:MAX or min_nodes, not both")
            least = coerce_int("min_nodes", self.min_nodes, minimum=1, maximum=nodes)
        least = None if least == nodes else least
        if least is not None and not backend_cls.supports_elastic:
            from dtrain.launch.backends import elastic_backends

            raise SpecError("nodes", f"{least}:{nodes}", f"a fixed count on backend {self.backend!r} (elastic jobs: "
                                                         f"{', '.join(elastic_backends())})")
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "min_nodes", least)

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

    def _check_gpus(self, on_this_host: bool) -> None:
        # This host's GPUs say nothing about remote nodes: count them only for a backend
        # running here, unless the user stated gpus_per_node.
        if not on_this_host and self.gpus_per_node is None:
            return
        capacity = self.gpu_capacity()
        if self.device == "gpu" and capacity == 0:
            raise SpecError("device", "gpu", "a host with at least one visible GPU (none found)")
        if capacity > 0 and self.device != "cpu" and self.procs_per_node > capacity:
            raise SpecError(
                "procs_per_node",
                self.procs_per_node,
                f"at most the {capacity} GPU(s) per node on this host (use device='cpu' to run on CPU)",
            )
