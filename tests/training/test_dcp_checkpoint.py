"""DCP checkpoints in one process (real torch.distributed.checkpoint, no process group): what gets
committed, retention, the asynchronous save's rules, the location grammar and the data position."""

from __future__ import annotations

import json
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from dtrain.errors import SpecError  # noqa: E402
from dtrain.training import CheckpointManager  # noqa: E402
from dtrain.training.data_position import ResumableSampler  # noqa: E402
from dtrain.rundir import DCP_MARKER as MARKER  # noqa: E402
from dtrain.training.dcp import ModelState  # noqa: E402
from dtrain.training.preemption import PreemptionGuard  # noqa: E402
from dtrain.training.shards import ShardSampler  # noqa: E402


def plain_state(value: float) -> dict:
    return {"w": torch.full((4, 3), float(value)), "meta": {"epoch": int(value)}}


def manager(tmp_path, **kwargs) -> CheckpointManager:
    return CheckpointManager(str(tmp_path / "ckpt"), every_n_steps=1, format="dcp", **kwargs)


def test_plain_state_dict_round_trip_and_only_committed_checkpoints_count(tmp_path, monkeypatch):
    ckpt = manager(tmp_path)
    assert ckpt.load_latest(into=plain_state(0)) is None
    ckpt.save(1, plain_state(1))
    ckpt.save(2, plain_state(2))
    # A save of step 3 cut short after its shards and .metadata, before the marker: never trusted.
    monkeypatch.setattr(ckpt._dcp, "_commit", lambda *args: None)
    ckpt.save(3, plain_state(3))
    assert (tmp_path / "ckpt" / "dcp" / "step-00000003" / ".metadata").exists()
    assert ckpt.steps() == [1, 2]
    into = plain_state(0)
    loaded = ckpt.load_latest(into=into)
    assert loaded["step"] == 2 and torch.equal(into["w"], torch.full((4, 3), 2.0)) and into["meta"] == {"epoch": 2}
    assert ckpt.latest_path().endswith("/dcp/step-00000002")


@pytest.mark.parametrize("marker", [b"{", b"[]", b'{"step": 7, "world_size": 1, "time": 1}',
                                    b'{"step": 2, "world_size": 0, "time": 1}',
                                    b'{"step": 2, "world_size": 1, "time": 1, "metric": "NaN"}'])
def test_a_marker_this_code_did_not_write_is_no_commit(tmp_path, marker):
    ckpt = manager(tmp_path)
    ckpt.save(2, plain_state(2))
    (tmp_path / "ckpt" / "dcp" / "step-00000002" / MARKER).write_bytes(marker)
    assert ckpt.steps() == []


def test_retention_keeps_the_last_k_and_the_best_and_removes_debris(tmp_path):
    ckpt = manager(tmp_path, keep=2, keep_best="min")
    (tmp_path / "ckpt" / "dcp" / "step-00000000").mkdir(parents=True)  # a save that never completed
    for step, loss in zip(range(1, 6), [5.0, 1.0, 4.0, 3.0, 2.0]):
        ckpt.save(step, plain_state(step), metric=loss)
    assert ckpt.steps() == [2, 4, 5]  # the best (loss 1.0) and the last two
    assert sorted(p.name for p in (tmp_path / "ckpt" / "dcp").iterdir()) == [
        "step-00000002", "step-00000004", "step-00000005"]


def test_async_save_writes_the_state_as_it_was_when_save_returned(tmp_path):
    ckpt = manager(tmp_path, async_save=True)
    state = plain_state(1)
    for step in (1, 2):  # the second save reuses the first one's host buffers: its own values go out
        state["w"].fill_(float(step))
        ckpt.save(step, state)
        state["w"].add_(100.0)  # the next optimizer step, while the upload runs
        ckpt.wait()
        into = plain_state(0)
        assert ckpt.load_latest(into=into)["step"] == step
        assert torch.equal(into["w"], torch.full((4, 3), float(step)))


class SlowWrites:
    """Counts how many checkpoint writes run at once (each takes 0.3 s)."""

    def __init__(self, ckpt):
        self.running = self.most = 0
        self.lock = threading.Lock()
        open_writer = ckpt._dcp.storage.writer

        def writer(name, host_buffers=None):
            w = open_writer(name, host_buffers)
            write_data = w.write_data

            def slow(*args, **kwargs):
                with self.lock:
                    self.running += 1
                    self.most = max(self.most, self.running)
                time.sleep(0.3)
                try:
                    return write_data(*args, **kwargs)
                finally:
                    with self.lock:
                        self.running -= 1

            w.write_data = slow
            return w

        ckpt._dcp.storage.writer = writer


def test_only_one_asynchronous_save_is_in_flight(tmp_path):
    ckpt = manager(tmp_path, async_save=True, keep=5)
    slow = SlowWrites(ckpt)
    for step in (1, 2, 3):
        ckpt.save(step, plain_state(step))
    ckpt.wait()
    assert slow.most == 1
    assert ckpt.steps() == [1, 2, 3]


def test_a_stop_request_makes_the_asynchronous_save_land_before_save_returns(tmp_path):
    ckpt = manager(tmp_path, async_save=True)
    SlowWrites(ckpt)
    guard = PreemptionGuard(announce=False)
    try:
        guard.request_stop()
        ckpt.save(4, plain_state(4))
        assert (tmp_path / "ckpt" / "dcp" / "step-00000004" / MARKER).exists()
    finally:
        guard.uninstall()


def test_model_and_optimizer_through_model_state(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    ckpt = manager(tmp_path)
    ckpt.save(1, {"app": ModelState(model, optimizer)})
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    ckpt.load_latest(into={"app": ModelState(fresh, fresh_opt)})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    saved, loaded = optimizer.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for key in saved:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved[key][name], loaded[key][name]), (key, name)


@pytest.mark.parametrize("where", ["relative/dir", "s3://bucket/a/../b", "s3://Bucket/x", "/fsx/a b"])
def test_a_bad_location_is_refused_before_anything_is_created(tmp_path, where, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as e:
        CheckpointManager(where, format="dcp")
    assert "directory=" in str(e.value) and "s3://bucket/prefix" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_torch_format_refuses_dcp_only_options(tmp_path):
    with pytest.raises(SpecError, match="format="):
        CheckpointManager(str(tmp_path), async_save=True)


def test_shard_sampler_position_resumes_at_another_world_size(tmp_path):
    """4 ranks train 3 steps of 5 samples, the position goes through a DCP checkpoint, 2 ranks finish the
    epoch: every sample of the epoch exactly once (ShardSampler's own permutation)."""
    samples, batch = 100, 5
    seen = []
    four = [ResumableSampler(ShardSampler(samples, 4, r, seed=7)) for r in range(4)]
    for sampler in four:
        sampler.set_epoch(2)
        seen += sampler.indices_array()[: 3 * batch].tolist()
        sampler.advance(3 * batch)
    ckpt = manager(tmp_path)
    ckpt.save(3, {"data": four[0]})
    two = [ResumableSampler(ShardSampler(samples, 2, r, seed=7)) for r in range(2)]
    for sampler in two:
        ckpt.load_latest(into={"data": sampler})
        sampler.set_epoch(2)
        assert (sampler.epoch, sampler.consumed) == (2, 60)
        seen += sampler.indices_array().tolist()
        assert len(sampler) == 20
    assert sorted(seen) == list(range(samples))
    whole = ShardSampler(samples, 1, 0, seed=7)
    whole.set_epoch(2)
    assert set(seen[:60]) == set(whole.indices()[:60])  # the first 60 of the epoch's permutation, as trained


def test_the_run_directory_lists_complete_dcp_checkpoints_and_a_remote_index(tmp_path, monkeypatch):
    from dtrain.rundir import RunDir

    run = tmp_path / "run"
    ckpt = CheckpointManager(str(run / "checkpoints"), every_n_steps=1, format="dcp", keep=3)
    ckpt.save(1, plain_state(1))
    monkeypatch.setattr(ckpt._dcp, "_commit", lambda *args: None)
    ckpt.save(2, plain_state(2))  # cut short before its marker: not listed
    (run / "checkpoints" / "remote.json").write_text(json.dumps({"location": "s3://bkt/runs/r1/ckpt/dcp", "checkpoints": [
        {"step": 6, "world_size": 4, "time": 5.0, "metric": None, "size_bytes": 1234},
        {"step": "7", "world_size": 4, "time": 5.0}, {"step": 8, "world_size": 0, "time": 5.0}]}))
    found = RunDir(str(run)).checkpoints()
    assert [(c["step"], c["name"], c["kind"], c["world_size"]) for c in found] == [
        (1, "dcp/step-00000001", "dcp", 1), (6, "s3://bkt/runs/r1/ckpt/dcp/step-00000006", "dcp", 4)]
    assert found[0]["size_bytes"] > 0 and found[1]["size_bytes"] == 1234
    (run / "checkpoints" / "remote.json").write_text(json.dumps({"location": "file:///etc", "checkpoints": [
        {"step": 6, "world_size": 4, "time": 5.0}]}))
    assert [c["step"] for c in RunDir(str(run)).checkpoints()] == [1]


def test_a_remote_location_keeps_its_index_in_the_run_directory(tmp_path, s3, monkeypatch):
    index = tmp_path / "run" / "checkpoints"
    monkeypatch.setenv("DTRAIN_CHECKPOINT_DIR", str(index))
    ckpt = CheckpointManager(s3.url("ckpt"), every_n_steps=1, format="dcp", keep=1)
    ckpt.save(3, plain_state(3))
    ckpt.save(5, plain_state(5))
    recorded = json.loads((index / "remote.json").read_text())
    assert recorded["location"] == f"s3://{s3.bucket}/ckpt/dcp"
    assert [(c["step"], c["world_size"]) for c in recorded["checkpoints"]] == [(5, 1)]
    assert recorded["checkpoints"][0]["size_bytes"] > 0
