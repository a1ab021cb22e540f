"""Per-step metrics without a wait for the device per step: TrainLoop with a tensor loss reads it once a
chunk, the lines keep their format, a chunk is written only once the device has passed it (a fake
device clock: a mock for the GPU only), and the GPU loop bench runs small on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import torch

from dtrain.training.loop import TrainLoop
from dtrain.training.metrics import MetricsWriter, StepRecorder
from dtrain.training.preemption import PreemptionGuard

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORD_KEYS = {"step", "epoch", "loss", "samples", "step_time_s", "data_wait_s", "samples_per_s", "time"}


class HostReads(torch.Tensor):
    """A tensor that counts every way of reading its value on the host (a host-device sync on a GPU)."""

    reads = 0
    READERS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__float__,
               torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.READERS:
            HostReads.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


class Batches:
    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return iter(range(self.count))

    def set_epoch(self, epoch: int) -> None:
        pass


def train(tmp_path, monkeypatch, steps: int, every: int, as_tensor: bool):
    monkeypatch.setenv("DTRAIN_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("DTRAIN_METRICS_DIR", str(tmp_path / "metrics"))
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loop = TrainLoop(model, optimizer, rank=0, checkpoint_every=10 * steps, guard=PreemptionGuard(install=False),
                     metrics_every=every, metrics_delay_s=1e9)  # chunks cut by steps only: the count is exact
    losses: list[torch.Tensor] = []

    def train_step(batch):
        loss = model(torch.tensor([[float(batch)]])).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
        return (loss.detach().as_subclass(HostReads) if as_tensor else loss.item()), 1

    HostReads.reads = 0
    assert loop.run(Batches(steps), Batches(steps), 1, train_step) == steps
    reads = HostReads.reads
    lines = [json.loads(line) for line in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    return loop, reads, lines, [t.item() for t in losses]


def test_a_tensor_loss_is_read_once_a_chunk_and_every_step_is_written(tmp_path, monkeypatch):
    loop, reads, lines, losses = train(tmp_path, monkeypatch, steps=23, every=5, as_tensor=True)
    assert 1 <= reads <= math.ceil(23 / 5)  # not once a step
    assert [line["step"] for line in lines] == list(range(1, 24))
    assert [line["loss"] for line in lines] == losses
    assert {key for line in lines for key in line} == RECORD_KEYS  # the stall report's format
    assert all(line["step_time_s"] >= line["data_wait_s"] >= 0 and line["samples"] == 1 for line in lines)
    assert loop.last_loss == losses[-1]


def test_a_float_loss_writes_the_same_lines(tmp_path, monkeypatch):
    loop, _, lines, losses = train(tmp_path, monkeypatch, steps=7, every=3, as_tensor=False)
    assert [line["loss"] for line in lines] == losses and [line["step"] for line in lines] == list(range(1, 8))
    assert {key for line in lines for key in line} == RECORD_KEYS
    assert loop.last_loss == losses[-1]


class FakeDeviceClock:
    """A mock for the GPU only: marks are numbers the fake device passes when the test says so."""

    def __init__(self):
        self.issued, self.passed_up_to, self.waits = 0, 0, []

    def mark(self) -> int:
        self.issued += 1
        return self.issued

    def passed(self, mark: int) -> bool:
        return mark <= self.passed_up_to

    def wait(self, mark: int) -> None:
        if not self.passed(mark):  # a real wait for the device (one on a passed mark returns at once)
            self.waits.append(mark)
            self.passed_up_to = mark

    def times(self, fetch: int, start: int, end: int) -> tuple[float, float]:
        return float(end - fetch), float(start - fetch)


def test_a_chunk_is_written_once_the_device_passed_it_and_waited_for_only_a_chunk_later(tmp_path):
    clock = FakeDeviceClock()
    recorder = StepRecorder(MetricsWriter(0, str(tmp_path)), clock, every=2, max_delay_s=1e9)
    written = lambda: len((tmp_path / "rank0.jsonl").read_text().splitlines())  # noqa: E731

    def step(n: int) -> None:
        recorder.record(step=n, epoch=0, loss=torch.tensor(float(n)), samples=1,
                        marks=(clock.mark(), clock.mark(), clock.mark()))

    step(1), step(2)  # chunk 1 cut, the device has not passed it
    assert written() == 0 and clock.waits == []
    clock.passed_up_to = clock.issued  # the device catches up: written at the next step, without a wait
    step(3)
    assert written() == 2 and clock.waits == []
    step(4)  # chunk 2 cut, not passed
    step(5), step(6)  # chunk 3 cut: chunk 2 is written now, the one wait
    assert written() == 4 and len(clock.waits) == 1
    recorder.close()
    lines = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [(line["step"], line["loss"], line["step_time_s"], line["data_wait_s"]) for line in lines] == [
        (n, float(n), 2.0, 1.0) for n in range(1, 7)]


def test_the_gpu_loop_bench_runs_small_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_loop.py"), "--quick", "--device", "cpu",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    names = [line.split(":", 2)[1].split(",")[0].strip() for line in done.stdout.splitlines()]
    assert names == ["ceiling", "TrainLoop float loss", "TrainLoop tensor loss"], done.stdout
    assert all(line.endswith("[-]") for line in done.stdout.splitlines())  # quick: no goal judged
    assert os.listdir(tmp_path) == []  # its scratch folder went with it
