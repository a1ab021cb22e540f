"""init_distributed binds an NCCL group to this rank's GPU (device_id) on every path, DeepSpeed's included:
which device it passes, given LOCAL_RANK, is checked with a GPU mock (CUDA reported available, and a
stand-in for the NCCL group that cannot be made on a CPU); on a CPU the gloo group gets no device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtrain.training import dist as training_dist


@pytest.fixture
def gpu_mock(monkeypatch):
    """A mock for the GPU only: CUDA is 'available', set_device and the NCCL group are recorded."""
    calls: dict = {"set_device": [], "groups": []}
    monkeypatch.setattr(training_dist, "_use_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", calls["set_device"].append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls["groups"].append(kwargs))
    monkeypatch.setattr("dtrain.training.watchdog.start_dump_responder", lambda: None)
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    return calls


def job_env(monkeypatch, world: int, rank: int, local_rank: int, master: bool = True) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value) if master else monkeypatch.delenv(name, raising=False)


def test_an_nccl_group_is_made_on_the_ranks_own_gpu(gpu_mock, monkeypatch):
    job_env(monkeypatch, world=8, rank=6, local_rank=2)
    ctx = training_dist.init_distributed()
    assert (ctx.backend, ctx.device) == ("nccl", "cuda:2")
    assert gpu_mock["set_device"] == [2]
    [group] = gpu_mock["groups"]
    assert group["backend"] == "nccl" and group["device_id"] == torch.device("cuda", 2)
    assert "store" not in group  # the launcher's MASTER_ADDR/MASTER_PORT


def test_deepspeeds_group_of_one_is_made_here_with_its_device(gpu_mock, monkeypatch):
    job_env(monkeypatch, world=1, rank=0, local_rank=0)
    training_dist.init_distributed()
    assert gpu_mock["groups"] == []  # one process, no DeepSpeed: no group at all
    training_dist.init_distributed(group_of_one=True)
    [group] = gpu_mock["groups"]
    assert group["device_id"] == torch.device("cuda", 0) and "store" not in group


def test_a_group_of_one_without_a_launcher_needs_no_port(gpu_mock, monkeypatch):
    job_env(monkeypatch, world=1, rank=0, local_rank=0, master=False)
    training_dist.init_distributed(group_of_one=True)
    [group] = gpu_mock["groups"]
    assert isinstance(group["store"], dist.HashStore) and (group["rank"], group["world_size"]) == (0, 1)


def test_only_nccl_on_a_gpu_gets_a_device():
    assert training_dist.group_device("nccl", "cuda:3") == {"device_id": torch.device("cuda", 3)}
    assert training_dist.group_device("gloo", "cuda:3") == {}  # a gloo group on a GPU host: no device bound
    assert training_dist.group_device("gloo", "cpu") == {}


def test_a_real_gloo_group_of_one_on_the_cpu(monkeypatch):
    monkeypatch.setenv("DTRAIN_DEVICE", "cpu")
    job_env(monkeypatch, world=1, rank=0, local_rank=0, master=False)
    monkeypatch.setattr("dtrain.training.watchdog.start_dump_responder", lambda: None)
    try:
        ctx = training_dist.init_distributed(group_of_one=True)
        assert dist.is_initialized() and dist.get_world_size() == 1 and ctx.backend == "gloo"
        flag = torch.ones(1)
        dist.all_reduce(flag)
        assert flag.item() == 1
    finally:
        training_dist.shutdown()
