"""Initialise torch.distributed from the env contract, whatever launched the process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from dtrain.launch.node.env_contract import contract_from_env


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    backend: str
    device: str  # "cpu" or "cuda:N"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _use_cuda() -> bool:
    import torch

    if os.environ.get("DTRAIN_DEVICE") == "cpu":
        return False
    return torch.cuda.is_available()


def init_distributed(backend: str | None = None, timeout_s: float = 300.0, *, group_of_one: bool = False) -> DistContext:
    """Join the process group described by the environment (torchrun, mpirun, Slurm via torchrun).

    nccl when CUDA is available (one GPU per LOCAL_RANK), gloo on CPU. A single
    process with no launcher env runs as world size 1 without a process group, unless
    ``group_of_one``: DeepSpeed needs a group even then, and makes its own without a device at
    world size 1 (NCCL then guesses the GPU from the global rank), but reuses one made here.
    An NCCL group is bound to this rank's GPU (``device_id``), on every path.
    """
    import torch
    import torch.distributed as dist

    from dtrain.training.watchdog import start_dump_responder

    start_dump_responder()  # answers the launcher's stack dump request if it watches for hangs
    os.environ.update(contract_from_env(os.environ))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = _use_cuda()
    backend = backend or ("nccl" if cuda else "gloo")
    device = "cpu"
    if cuda:
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if (world_size > 1 or group_of_one) and not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s),
                                **group_device(backend, device), **_store_of_one(dist, world_size))
    return DistContext(
        rank=rank, world_size=world_size, local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        node_rank=int(os.environ.get("NODE_RANK", "0")), backend=backend, device=device,
    )


def group_device(backend: str, device: str) -> dict:
    """``device_id`` for a process group with NCCL on a GPU: bound to its device, NCCL needs no guess
    of which GPU a rank uses ("Guessing device ID based on global rank"), and a barrier knows its
    device ("barrier(): using the device under current context"). Other backends get none."""
    import torch

    if "nccl" in backend and device.startswith("cuda"):
        return {"device_id": torch.device(device)}
    return {}


def _store_of_one(dist, world_size: int) -> dict:
    """A single process without a launcher's MASTER_ADDR/MASTER_PORT: an in-process store, no port."""
    if world_size == 1 and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        return {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    return {}


def shutdown() -> None:
    import sys

    import torch.distributed as dist

    checkpoints = sys.modules.get("dtrain.training.dcp")
    if checkpoints is not None:  # an asynchronous checkpoint may still be uploading on these groups
        checkpoints.wait_all()

    if dist.is_initialized():
        dist.destroy_process_group()


def exit_now(code: int = 0) -> None:
    """End a rank with ``code`` once its work is saved, skipping the interpreter's teardown.

    With gloo, tearing down the interpreter sometimes aborts the process ("terminate called
    without an active exception", exit 134) after everything succeeded: process-group objects
    still referenced (by DDP, by DeepSpeed's engine) are destroyed during finalization
    (pytorch#179291, #190489). A rank that finished and destroyed its process groups has nothing
    left to do, so it flushes its output and logs and exits here. Use it as a script's last call:
    ``if __name__ == "__main__": exit_now(main())``.
    """
    import logging

    from dtrain.launch.node.quick_exit import flush_output

    shutdown()
    flush_output()
    logging.shutdown()
    os._exit(code)
