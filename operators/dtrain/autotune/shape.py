"""Where an autotuning run goes: this host, or the ssh backend's hosts; CPU or GPU."""

from __future__ import annotations

from typing import Any, Mapping

from dtrain.errors import SpecError


def device_and_hosts(backend: str, backend_options: Mapping[str, Any], nodes: int | str, procs_per_node: int | str,
                     device: str = "auto") -> tuple[str, list[str] | None]:
    """``(device, hosts)``: hosts None for this host (backend local), the ssh hosts' addresses otherwise."""
    from dtrain.launch.spec import LaunchSpec, visible_gpu_count

    backend = str(backend).strip().lower()
    if backend not in ("local", "ssh"):
        raise SpecError("backend", backend, "local or ssh (DeepSpeed's autotuner reaches the nodes itself)")
    if device not in ("auto", "cpu", "gpu"):
        raise SpecError("device", device, "auto, cpu or gpu")
    if device == "auto":
        device = "gpu" if visible_gpu_count() > 0 else "cpu"
    if backend == "local":
        return device, None
    # The ssh backend parses and checks its hosts (hostfile, hosts or conn_id) as for a launch.
    spec = LaunchSpec(command=["python", "-c", "pass"], nodes=nodes, procs_per_node=procs_per_node, backend="ssh",
                      backend_options=dict(backend_options), device="cpu" if device == "cpu" else "auto")
    return device, [host.address for host in spec.resolved]
