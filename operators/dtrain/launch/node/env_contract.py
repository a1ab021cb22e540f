"""The environment contract every rank sees (names as AzureML and torchrun set them).

Stdlib only: imported by the per-rank entry point and by training scripts.

| variable                      | meaning                                   |
|-------------------------------|-------------------------------------------|
| MASTER_ADDR, MASTER_PORT      | host and port of rank 0's rendezvous      |
| WORLD_SIZE                    | nodes x procs_per_node                    |
| RANK                          | global rank, 0..WORLD_SIZE-1              |
| LOCAL_RANK, LOCAL_WORLD_SIZE  | rank within the node, procs on the node   |
| NODE_RANK                     | node index (torchrun's GROUP_RANK)        |

Set as well, as the ``deepspeed`` launcher sets them (scripts and DeepSpeed's CPU accelerator
read them): LOCAL_SIZE (= LOCAL_WORLD_SIZE), CROSS_RANK (= NODE_RANK) and CROSS_SIZE (nodes).
"""

from __future__ import annotations

from typing import Mapping

CONTRACT_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


def contract_from_env(environ: Mapping[str, str], *, mpi_per_node_launch: bool = False) -> dict[str, str]:
    """Complete the contract from whatever launcher started this process.

    torchrun sets everything but NODE_RANK, which is its GROUP_RANK. mpirun sets
    OMPI_COMM_WORLD_*; then NODE_RANK = rank // local size for per-process launch,
    or the world rank itself for per-node launch (one process per node starting its
    own workers). OMPI_COMM_WORLD_NODE_RANK is deliberately not used: it is the
    rank among processes on the node, not the node index (the AzureML guide warns).
    """
    out: dict[str, str] = {}
    if "RANK" in environ and "WORLD_SIZE" in environ:
        if "NODE_RANK" not in environ and "GROUP_RANK" in environ:
            out["NODE_RANK"] = environ["GROUP_RANK"]
        if "LOCAL_WORLD_SIZE" not in environ and "WORLD_SIZE" in environ and "GROUP_WORLD_SIZE" in environ:
            out["LOCAL_WORLD_SIZE"] = str(int(environ["WORLD_SIZE"]) // int(environ["GROUP_WORLD_SIZE"]))
        return out
    if "OMPI_COMM_WORLD_RANK" in environ:
        rank = int(environ["OMPI_COMM_WORLD_RANK"])
        size = int(environ["OMPI_COMM_WORLD_SIZE"])
        local_rank = int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
        local_size = int(environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
        node_rank = rank if mpi_per_node_launch else rank // local_size
        out.update(
            RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(local_size), NODE_RANK=str(node_rank),
        )
        master = environ.get("AZ_BATCH_MASTER_NODE", "")
        if "MASTER_ADDR" not in environ and ":" in master:
            addr, port = master.rsplit(":", 1)
            out.update(MASTER_ADDR=addr, MASTER_PORT=port)
    return out


def deepspeed_launcher_env(environ: Mapping[str, str]) -> dict[str, str]:
    """LOCAL_SIZE, CROSS_RANK and CROSS_SIZE from a complete contract ({} when it is not complete)."""
    try:
        local_size = int(environ["LOCAL_WORLD_SIZE"])
        world_size = int(environ["WORLD_SIZE"])
        node_rank = int(environ["NODE_RANK"])
    except (KeyError, ValueError):
        return {}
    return {"LOCAL_SIZE": str(local_size), "CROSS_RANK": str(node_rank),
            "CROSS_SIZE": str(world_size // max(local_size, 1))}
