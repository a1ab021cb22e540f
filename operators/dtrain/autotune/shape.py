"""Where an autotuning run goes: this host, or the nodes a backend names; CPU or GPU.

The backend registry answers (no backend name is compared here): a single-host backend means
this host; otherwise the backend's ``node_access`` gives the node addresses DeepSpeed's hostfile
lists. A backend that only learns its nodes when a job starts (Slurm) cannot host autotuning.
"""

from __future__ import annotations

from typing import Any, Mapping

from dtrain.errors import SpecError


def device_and_hosts(backend: str, backend_options: Mapping[str, Any], nodes: int | str, procs_per_node: int | str,
                     device: str = "auto") -> tuple[str, list[str] | None]:
    """``(device, hosts)``: hosts None for this host, the backend's node addresses otherwise."""
    from dtrain.launch.backends import get_backend_class
    from dtrain.launch.backends.base import Backend
    from dtrain.launch.engine.spec import LaunchSpec, visible_gpu_count

    if device not in ("auto", "cpu", "gpu"):
        raise SpecError("device", device, "auto, cpu or gpu")
    if device == "auto":
        device = "gpu" if visible_gpu_count() > 0 else "cpu"
    backend_cls = get_backend_class(str(backend).strip().lower())  # SpecError naming the installed ones
    if backend_cls.single_host:
        return device, None
    if backend_cls.node_access.__func__ is Backend.node_access.__func__:  # the default: "this host"
        raise SpecError("backend", backend, "a backend that knows its nodes' addresses before a job starts "
                                            "(DeepSpeed's autotuner reaches them itself over ssh)")
    # The backend parses and checks its options (hostfile, hosts, conn_id...) as for a launch.
    spec = LaunchSpec(command=["python", "-c", "pass"], nodes=nodes, procs_per_node=procs_per_node,
                      backend=backend_cls.name, backend_options=dict(backend_options),
                      device="cpu" if device == "cpu" else "auto")
    return device, list(backend_cls.node_access(spec).addresses)
