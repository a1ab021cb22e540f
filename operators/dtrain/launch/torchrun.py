"""Render the torchrun agent command for one node. Pure: tested by exact comparison.

One agent per node; c10d rendezvous on the first node's address; the per-rank
entry point wraps the user's command (see rank_entry).
"""

from __future__ import annotations

from operators.launch.spec import LaunchSpec

RANK_ENTRY = ("-m", "operators.launch.rank_entry")


def agent_argv(spec: LaunchSpec, *, python: str, node_index: int, rdzv_host: str, rdzv_port: int, job_id: str) -> list[str]:
    """The argv that starts node ``node_index``'s torchrun agent."""
    is_host = 1 if node_index == 0 else 0
    return [
        python, "-m", "torch.distributed.run",
        f"--nnodes={spec.nodes}",
        f"--nproc-per-node={spec.procs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_host}:{rdzv_port}",
        f"--rdzv-id={job_id}",
        f"--rdzv-conf=is_host={is_host},join_timeout={int(spec.rdzv_timeout)}",
        f"--max-restarts={spec.max_restarts}",
        "--no-python",
        python, *RANK_ENTRY, *spec.command,
    ]
