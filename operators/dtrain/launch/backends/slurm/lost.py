"""A lost Slurm node: the launcher's half of the node lease (:mod:`dtrain.launch.node.lease`).

Slurm marks a silent node DOWN only after its SlurmdTimeout (300 s by default), and a job whose
node is cut off or frozen just waits meanwhile. So every poll of a running job also looks at the
nodes' leases in the run directory (:func:`dtrain.launch.core.lost.lost_by_leases`); on a sign,
every node's slurmd port is probed with a TCP handshake, each node's NodeAddr and Port from
``scontrol``:

* ``gone``: the port refuses or resets the handshake: the host's processes are gone (it crashed
  or rebooted), or its slurmd alone was killed: then the job cannot be controlled there any more,
  and the node's lease fences it (its own slurmd did not answer for ``lost_after``);
* ``frozen``: the handshake completes (the host's kernel answers) but the node's heartbeat is
  stale: its processes are stopped (slurmd speaks only when spoken to, so no banner tells);
* ``unreachable``: no answer within the probe's time (a partition), counted only once a node
  fenced itself, the job failed, or the node's heartbeat is older than ``lost_after``.

Only records the nodes' lease holders signed count (:func:`job_key`: the job's lease key, derived from
the secret in its handle); a handle without one (an earlier release's, or one rebuilt from a trigger
event) reads no lease, and Slurm's own state decides.
"""

from __future__ import annotations

import subprocess
from typing import Any, Callable, Collection, Mapping

from dtrain.grammar import SECRET
from dtrain.launch.backends.base import SECRET_KEY
from dtrain.launch.backends.slurm import render as R
from dtrain.launch.core.lost import PROBE_TIMEOUT_S, LostNode, handshake_fault, lost_by_leases
from dtrain.launch.node.lease import lease_key
from dtrain.launch.node.records import JobKey


def job_key(job_id: str, data: Mapping[str, Any]) -> JobKey | None:
    """The key job ``job_id``'s lease records are signed with, from its handle's ``data``; None without one."""
    secret = data.get(SECRET_KEY)
    return JobKey(job_id, lease_key(secret)) if isinstance(secret, str) and SECRET.fullmatch(secret) else None


def lost_node(job_id: str, slurm_job_id: str, run_dir: str, nodes: int, lost_after: float, *, failed: bool,
              key: JobKey, report: Callable[[str], None] = lambda line: None,
              now: float | None = None, exclude: Collection[int] = ()) -> LostNode | None:
    """The node job ``job_id`` (Slurm's ``slurm_job_id``) lost, when its leases signed with ``key`` show a sign
    of one; None otherwise. ``failed``: the job has ended with a failure; ``exclude``: nodes not to look
    at; ``report``: where refused records are named."""
    return lost_by_leases(run_dir, job_id, nodes, lost_after, failed=failed, now=now, exclude=exclude,
                          hosts=lambda: job_hosts(slurm_job_id), silent_daemon="slurmd", key=key, report=report,
                          probe=lambda address, port: handshake_fault(address, port, timeout=PROBE_TIMEOUT_S))


def job_hosts(job_id: str) -> list[tuple[str, int]]:
    """(NodeAddr, slurmd port) of each of the job's nodes in node-index order; [] when Slurm cannot say."""
    node_list = R.parse_scontrol_job(scontrol(R.show_job_argv(job_id))).get("NodeList", "")
    return node_hosts(node_list) if node_list and node_list != "(null)" else []


def node_hosts(node_list: str) -> list[tuple[str, int]]:
    """(NodeAddr, slurmd port) of each node of a Slurm node list, in node-index order (SLURM_NODEID follows
    ``scontrol show hostnames``); [] when Slurm cannot say where one of them is."""
    names = scontrol(R.hostnames_argv(node_list)).split()
    found = R.parse_nodes(scontrol(R.show_nodes_argv(node_list)))
    return [found[name] for name in names] if names and all(name in found for name in names) else []


def scontrol(argv: list[str]) -> str:
    """What ``argv`` (an scontrol query) printed; "" when it failed or did not answer within 30 s."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""
