"""The placement arguments every operator that places work shares (train, preflight, autotune):
one mixin for the arguments, their templating and their resolution into a
:class:`~dtrain.launch.backends.placement.Placement` (by the backend registry) when the task runs."""

from __future__ import annotations

from typing import Any, Sequence

from dtrain.launch.backends import operator_placement
from dtrain.launch.backends.placement import Placement
from dtrain.launch.core.spec_options import JOB_OPTIONS, PLACEMENT_OPTIONS

#: the placement's options, as :data:`~dtrain.launch.core.spec_options.JOB_OPTIONS` declares them
PLACEMENT_TABLE = JOB_OPTIONS.subset(PLACEMENT_OPTIONS)
#: the templated arguments of :class:`PlacementArgs`
PLACEMENT_FIELDS: Sequence[str] = PLACEMENT_TABLE.templated


class PlacementArgs:
    """The placement arguments of every operator that places work (train, preflight, autotune):
    stored at parse time (no I/O, no check: they may be templates), resolved into one
    :class:`~dtrain.launch.backends.placement.Placement` when the task runs. List
    :data:`PLACEMENT_FIELDS` in ``template_fields``."""

    def init_placement(self, **values: Any) -> None:
        """Store the placement arguments given (``nodes``, ``procs_per_node``, ``backend``,
        ``backend_options``, ``device``, ``gpus_per_node``); the others get their operator default."""
        for name, value in PLACEMENT_TABLE.operator_values(values).items():
            setattr(self, name, value)
        if values:
            raise TypeError(f"init_placement() got an unexpected keyword argument {sorted(values)[0]!r}")
        self.backend_options = self.backend_options or {}

    def resolve_placement(self) -> Placement:
        """The rendered arguments, checked, with the backend's options completed (once per task)."""
        return operator_placement(**{name: getattr(self, name) for name in PLACEMENT_TABLE.names})
