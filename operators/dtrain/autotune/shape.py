"""Where an autotuning run goes: this host, or the nodes a backend names; CPU or GPU.

The backend registry answers (no backend name is compared here): a single-host backend means
this host; otherwise the backend's ``node_access`` gives the node addresses DeepSpeed's hostfile
lists. A backend that only learns its nodes when a job starts (Slurm) cannot host autotuning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.errors import SpecError

if TYPE_CHECKING:
    from dtrain.launch.backends.placement import Placement


def device_and_hosts(placement: Placement) -> tuple[str, list[str] | None]:
    """``(device, hosts)``: hosts None for this host, the placement's node addresses otherwise."""
    from dtrain.launch.backends import get_backend_class
    from dtrain.launch.backends.base import Backend
    from dtrain.launch.backends.placement import visible_gpu_count

    device = placement.device
    if device == "auto":
        device = "gpu" if visible_gpu_count() > 0 else "cpu"
    backend_cls = get_backend_class(placement.backend)
    if backend_cls.single_host:
        return device, None
    if backend_cls.node_access.__func__ is Backend.node_access.__func__:  # the default: "this host"
        raise SpecError("backend", placement.backend, "a backend that knows its nodes' addresses before a job "
                                                      "starts (DeepSpeed's autotuner reaches them itself over ssh)")
    return device, list(backend_cls.node_access(placement).addresses)
