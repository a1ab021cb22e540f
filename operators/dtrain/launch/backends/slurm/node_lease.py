"""Runs on every node of a Slurm job, beside its agent: the node's lease (:mod:`dtrain.launch.node.lease`).

``python -m dtrain.launch.backends.slurm.node_lease --run-dir RD --node N --job-id J --lease S``
(the node shell starts it: :data:`.render.NODE_SHELL`). The targets come from Slurm, here, once:

* the **peer** is the next node's slurmd (node N+1, the last node's is node 0), as ``scontrol`` names
  its NodeAddr and Port for the job's node list (``SLURM_JOB_NODELIST``). A node cut off from the
  job's network cannot reach it, and fences itself after ``lost_after``; so does the node before a
  lost one, whose job is lost anyway. Not the controller: a slurmctld restart or outage longer than
  the lease would fence every job on the cluster, where Slurm itself lets them run on;
* **own** is this node's slurmd (``SLURMD_NODENAME``): killed, nothing could stop this node's ranks
  any more (Slurm signals a job's processes through it), so the node fences itself after the lease.

An elastic job's node (``--peer``: the launcher's rendezvous store) leases against that store instead:
its peers may come and go, and a node cut off from the store cannot take part in the next round.

A single-node job has no peer (the clock check and its own slurmd only). When Slurm cannot say where
the nodes are, the lease holds with the clock check only, and says so.

Its records are signed with the job's lease key, which it reads on stdin (:func:`.lease.read_key`):
the node shell hands on the line srun gave it, which the batch script took out of its environment
before anything else started (:func:`.render.render_sbatch`). Without it the lease still fences, and
says that the launcher will refuse its records.
"""

from __future__ import annotations

import os
import sys

from dtrain.errors import SpecError
from dtrain.launch.backends.slurm.lost import node_hosts
from dtrain.launch.node import lease


def targets(node_list: str, node: int) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    """(peer, own) for node ``node`` of ``node_list``; (None, None) when Slurm cannot say."""
    hosts = node_hosts(node_list) if node_list else []
    if not 0 <= node < len(hosts):
        return None, None
    return (hosts[(node + 1) % len(hosts)] if len(hosts) > 1 else None), hosts[node]


def main(argv: list[str] | None = None) -> int:
    args = lease.parse_args(argv, prog="python -m dtrain.launch.backends.slurm.node_lease", targets=("peer",))
    try:
        key = lease.read_key(0, args.job_id)  # then stdin is /dev/null: nothing started later can read the key's pipe
    except SpecError as e:
        key = None
        print(f"{lease.ANNOUNCE} node={args.node}: {e}", file=sys.stderr, flush=True)
    if key is None:
        print(f"{lease.ANNOUNCE} node={args.node}: no lease key on stdin: this node's lease records are unsigned, "
              "and the launcher refuses them", file=sys.stderr, flush=True)
    peer, own = targets(os.environ.get("SLURM_JOB_NODELIST", ""), args.node)
    peer = args.peer or peer
    if own is None:
        print(f"{lease.ANNOUNCE} node={args.node}: Slurm did not say where the job's nodes are: "
              "this node's lease checks the clock only", file=sys.stderr, flush=True)
    return lease.run(args.run_dir, args.node, args.job_id, args.lease, peer, own=own, key=key)


if __name__ == "__main__":
    sys.exit(main())
