"""Where a job's ranks go, as the job model names it: :class:`Placement` and :func:`visible_gpu_count`.

Both live below the job model, in :mod:`dtrain.launch.backends.placement`, because the backend
registry resolves a placement (:func:`dtrain.launch.backends.resolve_placement`: every field checked
against the backend's class); this module is their name in :mod:`dtrain.launch.core`, where the job
model, preflight and autotuning import them from.
"""

from __future__ import annotations

from dtrain.launch.backends.placement import DEVICES, Placement, visible_gpu_count

__all__ = ["DEVICES", "Placement", "visible_gpu_count"]
