"""Run the node checks on every node of a job, in parallel (at most the backend's fan-out at once), and summarise. Airflow-free.

The backend says how to run a command on each of its nodes (``Backend.node_commands``:
on this host for the local backend, over ssh for the ssh backend; Slurm allocates nodes
at submit time and checks them in its own prolog). A host that cannot be reached is a
failed check, not an exception.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from dtrain.errors import DTrainError, SpecError
from dtrain.preflight.node import MARK

if TYPE_CHECKING:
    from dtrain.launch.backends.placement import Placement


class PreflightError(DTrainError):
    """At least one node is not ready to train; the message is the summary."""


def _parse(node: int, host: str, proc: subprocess.CompletedProcess) -> dict[str, Any]:
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            report = json.loads(line[len(MARK):])
            report.update(node=node, host=host, reachable=True)
            return report
    reason = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    return {"node": node, "host": host, "reachable": proc.returncode != 255, "ok": False,
            "problems": [f"check did not run (exit {proc.returncode}): {reason[0]}"], "facts": {}}


def node_commands(placement: Placement, check_kwargs: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(host label, argv) for each node of ``placement``."""
    from dtrain.launch.backends import get_backend_class

    payload = json.dumps(check_kwargs, sort_keys=True)
    try:
        return get_backend_class(placement.backend).node_commands(placement, ["-m", "dtrain.preflight.node", payload])
    except SpecError as e:
        raise PreflightError(f"preflight for backend={placement.backend!r} is not supported: it needs {e.allowed}") \
            from e


def run_preflight(placement: Placement, *, manifest_path: str | None = None, manifest_sha256: str | None = None,
                  checkpoint_dir: str | None = None, min_free_gb: float = 1.0, expect_gpus: bool | None = None,
                  timeout_s: float = 120.0) -> dict[str, Any]:
    """Check every node of ``placement``; return {"ok", "nodes": [...], "nccl_env", "summary": [lines]}."""
    from dtrain.launch.backends import get_backend_class

    backend = get_backend_class(placement.backend)
    expect = placement.uses_gpu() if expect_gpus is None else expect_gpus
    kwargs = {"manifest_path": manifest_path, "manifest_sha256": manifest_sha256, "checkpoint_dir": checkpoint_dir,
              "min_free_gb": min_free_gb, "expect_gpus": expect, "procs_per_node": placement.procs_per_node,
              "master_addr": backend.node_access(placement).addresses[0]}
    commands = node_commands(placement, kwargs)
    fanout = backend.node_fanout(placement)

    def one(item):
        index, (host, argv) = item
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return {"node": index, "host": host, "reachable": False, "ok": False,
                    "problems": [f"no answer within {timeout_s:.0f}s"], "facts": {}}
        return _parse(index, host, proc)

    with ThreadPoolExecutor(max_workers=max(1, min(fanout, len(commands)))) as pool:
        nodes = list(pool.map(one, enumerate(commands)))
    nccl = nodes[0]["facts"].get("nccl_env", {}) if nodes and nodes[0]["ok"] else {}
    summary = [f"preflight: {sum(n['ok'] for n in nodes)}/{len(nodes)} node(s) ready"]
    for n in nodes:
        facts = n["facts"]
        status = "ok" if n["ok"] else "FAILED: " + "; ".join(n["problems"])
        summary.append(f"  node{n['node']} {n['host']}: gpus={facts.get('gpus', '?')} free_gb={facts.get('free_gb', '?')} "
                       f"ib={','.join(facts.get('infiniband', [])) or 'none'} "
                       f"iface={facts.get('socket_ifname') or '?'} -> {status}")
    summary.append(f"  NCCL settings: {' '.join(f'{k}={v}' for k, v in nccl.items()) or 'n/a'}")
    return {"ok": all(n["ok"] for n in nodes), "nodes": nodes, "nccl_env": nccl, "summary": summary}
