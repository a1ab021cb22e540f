"""The one renderer of the torchrun agent command line (the agent itself: :mod:`dtrain.launch.node.torchrun_agent`).

Every backend that starts torchrun agents renders them here; only the rendezvous differs:

* :class:`C10d` (local backend): ``dtrain-dynamic``, torchrun's dynamic c10d rendezvous at
  ``host:port`` (node ranks are assigned by the rendezvous) whose workers bootstrap from a store
  node 0's agent opens afresh each round
  (:func:`~dtrain.launch.node.torchrun_agent.restartable_dynamic_handler`).
* :class:`Elastic` (an elastic job, ``nodes="MIN:MAX"``): ``dtrain-c10d``
  (:mod:`dtrain.launch.node.elastic_rdzv`) at the store the launcher hosts, never on a node
  (:mod:`dtrain.launch.core.rdzv_store`); node ranks are assigned by each round, and each node
  names its own address (``--local-addr``: nodes on hosts of their own share no hostname to go by).
* :class:`Static` (ssh, slurm): membership is fixed by the backend, so a static rendezvous
  with ``--node-rank`` makes NODE_RANK (and so RANK) follow the backend's node order.
  ``endpoint``/``node_rank`` None leave them to torchrun's ``PET_MASTER_ADDR``,
  ``PET_MASTER_PORT`` and ``PET_NODE_RANK`` variables (Slurm sets them per node at run time).

Either way the agent is ``python -m dtrain.launch.node.torchrun_agent`` (:data:`AGENT`): torchrun
itself, with the ``dtrain-static`` rendezvous registered, run on each node.

Each worker runs the per-rank wrapper (:mod:`dtrain.launch.node.rank_entry`) around the user's argv.

Restarts (``max_restarts``; docs/restarts.md). A restarted worker must not find the previous
attempt's keys in its rendezvous store: with torch 2.13 and gloo, init_process_group reads the
dead ranks' addresses from them and fails ("Gloo connectFullMesh failed ... Connection
refused") or hangs. dtrain's rendezvous therefore hand each round's workers a fresh store hosted by
node 0's agent: ``dtrain-dynamic`` (:data:`~dtrain.launch.node.torchrun_agent.RESTARTABLE_DYNAMIC`),
``dtrain-static`` (:data:`~dtrain.launch.node.torchrun_agent.RESTARTABLE_STATIC`) and the elastic
``dtrain-c10d`` (:mod:`dtrain.launch.node.worker_store`).

Pure (tested by exact comparison), and no torch import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from dtrain.launch.node.elastic_rdzv import ELASTIC, KEEP_ALIVE_ATTEMPTS, KEEP_ALIVE_S
from dtrain.launch.node.torchrun_agent import RESTARTABLE_DYNAMIC, RESTARTABLE_STATIC

if TYPE_CHECKING:
    from dtrain.launch.core.spec import LaunchSpec

RANK_ENTRY = ("-m", "dtrain.launch.node.rank_entry")
AGENT = ("-m", "dtrain.launch.node.torchrun_agent")  # torchrun, with RESTARTABLE_STATIC and its clean-ups

# Environment every torchrun agent gets (through Job.rank_env, which every backend puts into the
# agents' environment; a spec's own ``env`` may override it). By default torchrun's c10d
# rendezvous opens one worker store in the first round and keeps it across worker restarts; with
# torch 2.13 and gloo the restarted ranks then read the previous attempt's addresses from it and
# die in init_process_group ("Gloo connectFullMesh failed ... Connection refused") or hang there.
# With this set, torch opens no such store: ``dtrain-dynamic`` and the elastic ``dtrain-c10d`` open
# one per round themselves (dtrain.launch.node.worker_store), so ``max_restarts`` really restarts the
# workers and they resume from their checkpoint (tests/launch/engine/faults/test_restart.py).
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True)
class C10d:
    host: str
    port: int
    is_host: bool


@dataclass(frozen=True)
class Static:
    endpoint: tuple[str, int] | None = None
    node_rank: int | None = None


@dataclass(frozen=True)
class Elastic:
    host: str
    port: int
    local_addr: str | None = None


Rendezvous = Union[C10d, Static, Elastic]

#: an elastic round completes this many seconds after MIN nodes joined (at once with MAX): the time a
#: late node has to make the first round, and what re-forming a round after a loss waits for one more
ELASTIC_LAST_CALL_S = 5


def rendezvous_args(spec: "LaunchSpec", job_id: str, rdzv: Rendezvous) -> list[str]:
    timeout = int(spec.rdzv_timeout)
    if isinstance(rdzv, Elastic):
        return ["--rdzv-backend=" + ELASTIC, f"--rdzv-endpoint={rdzv.host}:{rdzv.port}", f"--rdzv-id={job_id}",
                f"--rdzv-conf=is_host=0,join_timeout={timeout},last_call_timeout={ELASTIC_LAST_CALL_S},"
                f"keep_alive_interval={KEEP_ALIVE_S},keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS}",
                *([f"--local-addr={rdzv.local_addr}"] if rdzv.local_addr else [])]
    if isinstance(rdzv, C10d):
        return [f"--rdzv-backend={RESTARTABLE_DYNAMIC}", f"--rdzv-endpoint={rdzv.host}:{rdzv.port}",
                f"--rdzv-id={job_id}", f"--rdzv-conf=is_host={int(rdzv.is_host)},join_timeout={timeout}"]
    args = [f"--rdzv-backend={RESTARTABLE_STATIC}"]
    if rdzv.endpoint is not None:
        args.append(f"--rdzv-endpoint={rdzv.endpoint[0]}:{rdzv.endpoint[1]}")
    args += [f"--rdzv-id={job_id}", f"--rdzv-conf=timeout={timeout}"]
    if rdzv.node_rank is not None:
        args.append(f"--node-rank={rdzv.node_rank}")
    return args


def agent_argv(spec: "LaunchSpec", *, python: str, job_id: str, rdzv: Rendezvous) -> list[str]:
    """The argv that starts one node's torchrun agent."""
    return [
        python, *AGENT,
        f"--nnodes={spec.placement.nnodes}",
        f"--nproc-per-node={spec.placement.procs_per_node}",
        *rendezvous_args(spec, job_id, rdzv),
        f"--max-restarts={spec.max_restarts}",
        "--no-python",
        python, *RANK_ENTRY, *spec.command,
    ]
