"""dtrain.training.loop.TrainLoop in one process: a stop request mid-epoch saves the step it stopped at and
exits 143; a new loop resumes from that step and trains exactly the batches the first one had not, in the
same order; a warm start loads weights only when there is no checkpoint. (The multi-rank agreement is
PreemptionGuard's, tested in test_preemption.py; the example scripts run this loop on 2 ranks.)"""

from __future__ import annotations

import torch

from dtrain.training.loop import TrainLoop
from dtrain.training.preemption import PreemptionGuard
from dtrain.training.shards import ShardSampler

BATCH = 4


class Batches:
    """A loader over ids 0..19 in the sampler's order, 5 batches an epoch."""

    def __init__(self, sampler: ShardSampler):
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler) // BATCH

    def __iter__(self):
        order = self.sampler.indices()
        return (order[i:i + BATCH] for i in range(0, len(self) * BATCH, BATCH))


def make_loop(seen: list, stop_at: int | None = None):
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = PreemptionGuard(install=False)
    loop = TrainLoop(model, optimizer, rank=0, checkpoint_every=4, guard=guard)

    def train_step(batch):
        seen.append(tuple(batch))
        loss = model(torch.tensor([[float(len(seen))]])).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if len(seen) == stop_at:
            guard.request_stop()  # what SIGTERM does, between two steps
        return loss.item(), len(batch)

    return loop, train_step


def test_a_stop_saves_its_step_and_the_resume_trains_the_rest_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_CHECKPOINT_DIR", str(tmp_path / "reference"))
    monkeypatch.setenv("DTRAIN_METRICS_DIR", str(tmp_path / "metrics"))
    sampler = ShardSampler(20, num_replicas=1, rank=0, seed=1)
    whole: list = []
    reference, step_fn = make_loop(whole)  # uninterrupted, in a checkpoint directory of its own
    assert reference.run(Batches(sampler), sampler, 3, step_fn) == 15

    monkeypatch.setenv("DTRAIN_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    first: list = []
    loop, step_fn = make_loop(first, stop_at=7)  # mid-epoch 1, between the checkpoints of steps 4 and 8
    try:
        loop.run(Batches(sampler), sampler, 3, step_fn)
        raise AssertionError("a stop request must end the process")
    except SystemExit as stop:
        assert stop.code == 143
    assert loop.ckpt.steps() == [4, 7]  # the periodic checkpoint and the one of the step it stopped at

    rest: list = []
    again, step_fn = make_loop(rest)
    again.restore(init_from=str(tmp_path / "never-used.pt"), load_weights=lambda path: rest.append("warm"))
    assert (again.step, again.resumed_from, again.warm_start) == (7, 7, None)
    assert again.run(Batches(sampler), sampler, 3, step_fn) == 15
    assert first + rest == whole  # no batch twice, none left out, the same order
    lines = (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()
    assert len(lines) == 15 + 15  # the reference run's and the interrupted + resumed run's steps


def test_warm_start_loads_weights_only_without_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("DTRAIN_METRICS_DIR", str(tmp_path / "metrics"))
    weights = tmp_path / "champion.pt"
    loaded: list = []
    loop, _ = make_loop([])
    loop.restore(init_from=str(weights), load_weights=loaded.append)
    assert loaded == [] and loop.warm_start is None  # no such file: train from scratch
    weights.write_bytes(b"weights")
    loop.restore(init_from=str(weights), load_weights=loaded.append)
    assert loaded == [str(weights)] and loop.warm_start == str(weights) and loop.step == 0
