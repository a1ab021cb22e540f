"""The checkpoint's host buffers and its disk writer/reader, on CPU (real DCP, real files): every
asynchronous save of a training run loads back exactly, the buffers are kept between saves, a load
through them restores in place, and the files stay DCP's format."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402

from dtrain.training import CheckpointManager  # noqa: E402
from dtrain.training import dcp as dcp_module  # noqa: E402
from dtrain.training.dcp import ModelState  # noqa: E402
from dtrain.training.dcp_io import THREADS, crc32_off  # noqa: E402
from dtrain.training.host_buffers import HostBuffers  # noqa: E402


def model_and_adam(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def train(model, optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(6, 8)).pow(2).mean().backward()
        optimizer.step()


def snapshot(model, optimizer) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


def assert_same(expected: dict, model, optimizer) -> None:
    for name, tensor in expected["model"].items():
        assert torch.equal(model.state_dict()[name], tensor), name
    got = optimizer.state_dict()
    assert got["param_groups"] == expected["optimizer"]["param_groups"]
    for key, entries in expected["optimizer"]["state"].items():
        for name, value in entries.items():
            assert torch.equal(got["state"][key][name], value), (key, name)


def test_five_asynchronous_saves_in_a_row_each_load_back_exactly(tmp_path):
    model, optimizer = model_and_adam(0)
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), every_n_steps=1, keep=5, format="dcp", async_save=True)
    state = {"app": ModelState(model, optimizer)}
    expected = {}
    for step in range(1, 6):
        train(model, optimizer, 3)  # parameters and Adam's moments change between saves
        expected[step] = snapshot(model, optimizer)
        ckpt.save(step, state)
        train(model, optimizer, 1)  # training goes on while the write runs
    ckpt.wait()
    assert ckpt.steps() == [1, 2, 3, 4, 5]
    for step in range(1, 6):
        fresh, fresh_opt = model_and_adam(99)
        train(fresh, fresh_opt, 1)  # Adam's state exists, with other values
        dcp.load({"app": ModelState(fresh, fresh_opt)},
                 storage_reader=ckpt._dcp.storage.reader(f"step-{step:08d}"))
        assert_same(expected[step], fresh, fresh_opt)


def test_the_buffers_are_kept_between_saves_and_dropped_when_a_shape_changes():
    buffers = HostBuffers()
    state = {"w": torch.ones(4, 3), "opt": {"state": {0: {"step": torch.tensor(3.0), "m": torch.zeros(2)}},
                                            "param_groups": [{"lr": 0.1, "params": [0], "foreach": None}]}}
    first = buffers.stage(state)
    state["w"].fill_(7.0)  # after the stage: the staged copy keeps the old values
    assert torch.equal(first["w"], torch.ones(4, 3))
    assert first["opt"]["param_groups"] == state["opt"]["param_groups"]
    assert first["opt"]["param_groups"] is not state["opt"]["param_groups"]
    second = buffers.stage(state)
    assert second["w"].data_ptr() == first["w"].data_ptr()  # the same buffer, new values
    assert torch.equal(second["w"], torch.full((4, 3), 7.0))
    assert first["w"].data_ptr() != state["w"].data_ptr()
    before = buffers.nbytes
    state["w"] = torch.ones(8, 3)
    third = buffers.stage(state)
    assert third["w"].shape == (8, 3) and buffers.nbytes == before + 12 * 4


def test_a_load_through_the_host_buffers_restores_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(dcp_module, "_through_host", lambda state: True)  # the CUDA path's logic, on CPU
    model, optimizer = model_and_adam(0)
    train(model, optimizer, 2)
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), every_n_steps=1, format="dcp")
    ckpt.save(1, {"app": ModelState(model, optimizer), "extra": {"epoch": 3, "w": torch.arange(4.0)}})
    expected = snapshot(model, optimizer)
    fresh, fresh_opt = model_and_adam(7)
    train(fresh, fresh_opt, 1)
    extra = {"epoch": 0, "w": torch.zeros(4)}
    kept = extra["w"]
    into = {"app": ModelState(fresh, fresh_opt), "extra": extra}
    assert ckpt.load_latest(into=into)["step"] == 1
    assert_same(expected, fresh, fresh_opt)
    assert into["extra"] is extra and extra["epoch"] == 3 and extra["w"] is kept
    assert torch.equal(kept, torch.arange(4.0))


def test_the_files_are_dcp_format_in_several_files_per_rank(tmp_path):
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), every_n_steps=1, format="dcp")
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(2 * THREADS)}
    ckpt.save(1, state)
    folder = tmp_path / "ckpt" / "dcp" / "step-00000001"
    assert sorted(p.name for p in folder.glob("*.distcp")) == [f"__0_{i}.distcp" for i in range(THREADS)]
    into = {k: torch.zeros(64) for k in state}
    dcp.load(into, storage_reader=dcp.FileSystemReader(str(folder)))  # torch's own reader
    assert all(torch.equal(into[k], state[k]) for k in state)


def test_checksums_are_off_only_while_a_checkpoint_is_written():
    getter = torch.serialization.get_crc32_options
    assert getter() is True
    with crc32_off():
        with crc32_off():  # another writer thread of the same save
            assert getter() is False
        assert getter() is False
    assert getter() is True


def test_the_torch_format_writes_one_file_that_torch_load_reads_and_leaves_checksums_on(tmp_path):
    model, optimizer = model_and_adam(0)
    train(model, optimizer, 2)
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), every_n_steps=1)
    ckpt.save(3, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert torch.serialization.get_crc32_options() is True
    loaded = torch.load(ckpt.latest_path(), weights_only=True)
    fresh, fresh_opt = model_and_adam(5)
    fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optimizer"])
    assert loaded["step"] == 3
    assert_same(snapshot(model, optimizer), fresh, fresh_opt)
