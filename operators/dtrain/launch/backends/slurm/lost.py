"""A lost Slurm node: the launcher's half of the node lease (:mod:`dtrain.launch.node.lease`).

Slurm marks a silent node DOWN only after its SlurmdTimeout (300 s by default), and a job whose
node is cut off or frozen just waits meanwhile. So every poll of a running job also looks at the
nodes' leases in the run directory (a stat per node, a small read per fence record: cheap). When
one shows a sign -- a node fenced itself, a node's heartbeat is older than STALE_BEATS beats, or
the job failed -- every node's slurmd port is probed (a TCP handshake, in parallel; each node's
NodeAddr and Port from ``scontrol``, never from the run directory, which the ranks can write):

* ``gone``: the port refuses or resets the handshake: the host's processes are gone (it crashed
  or rebooted), or its slurmd alone was killed: then the job cannot be controlled there any more,
  and the node's lease fences it (its own slurmd did not answer for ``lost_after``);
* ``frozen``: the handshake completes (the host's kernel answers) but the node's heartbeat is
  stale: its processes are stopped (slurmd speaks only when spoken to, so no banner tells);
* ``unreachable``: no answer within the probe's time (a partition), counted only once a node
  fenced itself (the cut-off one, or its peer that could not reach it), the job failed, or the
  node's heartbeat is older than ``lost_after`` (a blip is not a lost node).

A node that fenced itself while every node answers is still lost (``unreachable``, with its own
reason): it could not reach its peer, or its own slurmd, and its ranks are gone.
"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from dtrain.launch.backends.slurm import render as R
from dtrain.launch.engine.lost import PROBE_TIMEOUT_S, LostNode, handshake_fault
from dtrain.launch.node.lease import HEARTBEAT_S, STALE_BEATS, beat_age, read_fence
from dtrain.rundir import RunDir


def stale_after() -> float:
    return STALE_BEATS * HEARTBEAT_S


def lost_node(job_id: str, slurm_job_id: str, run_dir: str, nodes: int, lost_after: float, *, failed: bool,
              now: float | None = None) -> LostNode | None:
    """The node job ``job_id`` (Slurm's ``slurm_job_id``) lost, when its leases show a sign of one; None
    otherwise. ``failed``: the job has ended with a failure (its heartbeats then stopped with it, so a
    stale one proves nothing).

    On a sign every node is probed, not only the ones that showed it: when node 1 is cut off or gone,
    node 0 fences itself too (it cannot reach node 1, its peer), and the verdict must name node 1."""
    now = time.time() if now is None else now
    files = RunDir(run_dir)
    fenced = {i: reason for i in range(nodes) if (reason := read_fence(files, job_id, i)) is not None}
    ages = {i: age for i in range(nodes) if (age := beat_age(files, job_id, i, now)) is not None}
    stale = set() if failed else {i for i, age in ages.items() if age >= stale_after()}
    if not (fenced or stale or (failed and ages)):
        return None
    hosts = job_hosts(slurm_job_id)
    if len(hosts) != nodes:  # Slurm cannot say where the nodes are (any more): nothing to probe
        return None
    with ThreadPoolExecutor(max_workers=min(32, nodes)) as pool:
        faults = list(pool.map(lambda i: handshake_fault(*hosts[i], timeout=PROBE_TIMEOUT_S), range(nodes)))
    for index, fault in enumerate(faults):
        address, why = hosts[index][0], f"; it fenced itself: {fenced[index]}" if index in fenced else ""
        if fault is None and index in stale:
            return LostNode(index, address, "frozen", f"its slurmd accepts connections but the node's heartbeat is "
                                                      f"{ages[index]:.0f} s old: its processes are stopped")
        if fault is not None and (fault[0] == "gone" or fenced or failed or ages.get(index, 0.0) >= lost_after):
            return LostNode(index, address, fault[0], fault[1] + why)
    if fenced:
        index = min(fenced)
        return LostNode(index, hosts[index][0], "unreachable", f"it fenced itself: {fenced[index]}")
    return None


def shows_a_lost_node(run_dir: str, job_id: str, nodes: int, now: float | None = None) -> bool:
    """Whether a node fenced itself or stopped beating: then Slurm cannot end the job before its
    SlurmdTimeout, and a cancel need not wait for it (the reachable nodes are stopped at once)."""
    now = time.time() if now is None else now
    files = RunDir(run_dir)
    return any(read_fence(files, job_id, i) is not None or (beat_age(files, job_id, i, now) or 0.0) >= stale_after()
               for i in range(nodes))


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
