"""The one renderer of the torchrun agent command line. Pure: tested by exact comparison.

Every backend that starts torchrun agents renders them here; only the rendezvous differs:

* :class:`C10d` (local backend): dynamic c10d rendezvous at ``host:port``; node ranks are
  assigned by the rendezvous.
* :class:`Static` (ssh, slurm): membership is fixed by the backend, so the static
  rendezvous with ``--node-rank`` makes NODE_RANK (and so RANK) follow the backend's node
  order. ``endpoint``/``node_rank`` None leave them to torchrun's ``PET_MASTER_ADDR``,
  ``PET_MASTER_PORT`` and ``PET_NODE_RANK`` variables (Slurm sets them per node at run time).

Each worker runs the per-rank wrapper (:mod:`dtrain.launch.rank_entry`) around the user's argv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from dtrain.launch.spec import LaunchSpec

RANK_ENTRY = ("-m", "dtrain.launch.rank_entry")


@dataclass(frozen=True)
class C10d:
    host: str
    port: int
    is_host: bool


@dataclass(frozen=True)
class Static:
    endpoint: tuple[str, int] | None = None
    node_rank: int | None = None


Rendezvous = Union[C10d, Static]


def rendezvous_args(spec: "LaunchSpec", job_id: str, rdzv: Rendezvous) -> list[str]:
    timeout = int(spec.rdzv_timeout)
    if isinstance(rdzv, C10d):
        return ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv.host}:{rdzv.port}", f"--rdzv-id={job_id}",
                f"--rdzv-conf=is_host={int(rdzv.is_host)},join_timeout={timeout}"]
    args = ["--rdzv-backend=static"]
    if rdzv.endpoint is not None:
        args.append(f"--rdzv-endpoint={rdzv.endpoint[0]}:{rdzv.endpoint[1]}")
    args += [f"--rdzv-id={job_id}", f"--rdzv-conf=timeout={timeout}"]
    if rdzv.node_rank is not None:
        args.append(f"--node-rank={rdzv.node_rank}")
    return args


def agent_argv(spec: "LaunchSpec", *, python: str, job_id: str, rdzv: Rendezvous) -> list[str]:
    """The argv that starts one node's torchrun agent."""
    return [
        python, "-m", "torch.distributed.run",
        f"--nnodes={spec.nodes}",
        f"--nproc-per-node={spec.procs_per_node}",
        *rendezvous_args(spec, job_id, rdzv),
        f"--max-restarts={spec.max_restarts}",
        "--no-python",
        python, *RANK_ENTRY, *spec.command,
    ]
