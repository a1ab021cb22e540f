"""distribution=tensorflow: TF_CONFIG for every process. Pure and stdlib only (runs on every rank).

The shape is TensorFlow's (and DESIGN.md's)::

    {"cluster": {"worker": ["host0:2222", ...], "ps": ["host1:2226", ...]},
     "task": {"type": "worker", "index": 0},
     "environment": "cloud"}

Every launched process is one TensorFlow task. With ``num_ps`` parameter servers
(legacy TF 1.x), the last ``num_ps`` global ranks are the ``ps`` tasks and the
others the workers (worker 0 is the chief, as TF assumes); without them the
cluster has no ``ps`` key, which MultiWorkerMirroredStrategy requires. Task
addresses: the node's host and ``base_port + global rank``, unique even when
several simulated nodes share one host.

How a rank gets its TF_CONFIG: the backend puts ``DTRAIN_TF_HOSTS`` (node hosts in
node-rank order, comma-separated), ``DTRAIN_TF_PORT`` and ``DTRAIN_TF_NUM_PS`` into
every rank's environment; :func:`tf_config_env` turns those plus the contract's
RANK, WORLD_SIZE and LOCAL_WORLD_SIZE into ``TF_CONFIG``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

DEFAULT_PORT = 2222


def cluster_spec(hosts: Sequence[str], procs_per_node: int, base_port: int = DEFAULT_PORT,
                 num_ps: int = 0) -> dict[str, list[str]]:
    """Addresses of every task: rank r runs on ``hosts[r // procs_per_node]`` at ``base_port + r``."""
    world = len(hosts) * procs_per_node
    if not 0 <= num_ps < world:
        raise ValueError(f"num_ps={num_ps} must leave at least one worker among {world} processes")
    addresses = [f"{hosts[r // procs_per_node]}:{base_port + r}" for r in range(world)]
    spec = {"worker": addresses[: world - num_ps]}
    if num_ps:
        spec["ps"] = addresses[world - num_ps:]
    return spec


def task_of_rank(rank: int, world_size: int, num_ps: int = 0) -> tuple[str, int]:
    workers = world_size - num_ps
    return ("worker", rank) if rank < workers else ("ps", rank - workers)


def tf_config(cluster: Mapping[str, Sequence[str]], task_type: str, task_index: int) -> dict[str, Any]:
    if task_type not in cluster or not 0 <= task_index < len(cluster[task_type]):
        raise ValueError(f"task {task_type}:{task_index} is not in the cluster {dict(cluster)}")
    return {
        "cluster": {name: list(addresses) for name, addresses in cluster.items()},
        "task": {"type": task_type, "index": task_index},
        "environment": "cloud",
    }


def tf_config_for_rank(rank: int, hosts: Sequence[str], procs_per_node: int, base_port: int = DEFAULT_PORT,
                       num_ps: int = 0) -> dict[str, Any]:
    cluster = cluster_spec(hosts, procs_per_node, base_port, num_ps)
    task_type, index = task_of_rank(rank, len(hosts) * procs_per_node, num_ps)
    return tf_config(cluster, task_type, index)


def backend_env(hosts: Sequence[str], base_port: int, num_ps: int) -> dict[str, str]:
    """What a backend adds to every rank's environment for distribution=tensorflow."""
    return {"DTRAIN_TF_HOSTS": ",".join(hosts), "DTRAIN_TF_PORT": str(base_port), "DTRAIN_TF_NUM_PS": str(num_ps)}


def tf_config_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``{"TF_CONFIG": ...}`` for this rank, or ``{}`` when the backend set no TF cluster or
    TF_CONFIG is already given (a user's own TF_CONFIG wins)."""
    if "TF_CONFIG" in environ or "DTRAIN_TF_HOSTS" not in environ:
        return {}
    hosts = [h for h in environ["DTRAIN_TF_HOSTS"].split(",") if h]
    world = int(environ["WORLD_SIZE"])
    procs = int(environ.get("LOCAL_WORLD_SIZE") or world // len(hosts))
    config = tf_config_for_rank(int(environ["RANK"]), hosts, procs,
                                int(environ.get("DTRAIN_TF_PORT", DEFAULT_PORT)), int(environ.get("DTRAIN_TF_NUM_PS", "0")))
    return {"TF_CONFIG": json.dumps(config, separators=(",", ":"))}
