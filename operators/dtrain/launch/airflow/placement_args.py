"""The placement arguments every operator that places work shares (train, preflight, autotune):
one mixin for the arguments, their templating and their resolution into a
:class:`~dtrain.launch.core.placement.Placement` when the task runs."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from dtrain.launch.core.placement import Placement

#: the templated arguments of :class:`PlacementArgs`
PLACEMENT_FIELDS: Sequence[str] = ("nodes", "procs_per_node", "backend", "backend_options")


class PlacementArgs:
    """The placement arguments of every operator that places work (train, preflight, autotune):
    stored at parse time (no I/O, no check: they may be templates), resolved into one
    :class:`~dtrain.launch.core.placement.Placement` when the task runs. List
    :data:`PLACEMENT_FIELDS` in ``template_fields``."""

    def init_placement(self, *, nodes: int | str = 1, procs_per_node: int | str = 1, backend: str = "local",
                       backend_options: Mapping[str, Any] | str | None = None, device: str = "auto",
                       gpus_per_node: int | None = None) -> None:
        self.nodes, self.procs_per_node, self.backend = nodes, procs_per_node, backend
        self.backend_options = backend_options or {}
        self.device, self.gpus_per_node = device, gpus_per_node

    def resolve_placement(self) -> Placement:
        """The rendered arguments, checked, with the backend's options completed (once per task)."""
        return Placement.for_operator(nodes=self.nodes, procs_per_node=self.procs_per_node, backend=self.backend,
                                      backend_options=self.backend_options, device=self.device,
                                      gpus_per_node=self.gpus_per_node)
