"""Per-rank metrics as JSON lines, and the run's final result, in the launcher's metrics directory.

Each line of ``rank{R}.jsonl``: step, epoch, loss, samples, step_time_s, data_wait_s,
samples_per_s, time, the rank's node, and with a collective timer comm_wait_s and compute_time_s.
The stall report reads these.

:class:`StepRecorder` writes the same lines without making the training step wait for the device: a
step's loss may stay a tensor, and its times are CUDA events on a GPU; both are read in chunks, a
chunk at a time, once the device has passed them (:meth:`StepRecorder.record`).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from typing import Any, Callable

from dtrain.rundir import RESULT, RunDir


def metrics_dir() -> str:
    return os.environ.get("DTRAIN_METRICS_DIR") or os.path.join(os.getcwd(), "metrics")


def node_index() -> int | None:
    """This process's node in the job: the launcher's ``DTRAIN_NODE_INDEX`` (every backend sets it),
    else torchrun's ``GROUP_RANK``; None when neither is a number (a script run by hand)."""
    for name in ("DTRAIN_NODE_INDEX", "GROUP_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


class MetricsWriter:
    def __init__(self, rank: int, directory: str | None = None):
        self.directory = os.path.abspath(directory or metrics_dir())
        self.path = os.path.join(self.directory, f"rank{rank}.jsonl")
        # never through a link another process of the job planted (dtrain.rundir)
        fd = RunDir(self.directory).open_append(os.path.basename(self.path))
        self._fh = os.fdopen(fd, "a", encoding="utf-8", buffering=1)
        self.node = node_index()


    def log(self, *, step: int, loss: float, samples: int, step_time_s: float, data_wait_s: float,
            epoch: int | None = None, comm_wait_s: float | None = None, **extra: Any) -> None:
        """One step. ``comm_wait_s``: the step's wait in its gradient all-reduce
        (:class:`dtrain.training.collectives.CollectiveTimer`); with it the record also holds the
        rank's own ``compute_time_s`` (the step without its data and collective waits), which is
        what tells a straggler apart in synchronous DDP, where every rank's step time is the same."""
        record = {
            "step": step, "epoch": epoch, "loss": float(loss), "samples": samples,
            "step_time_s": round(step_time_s, 6), "data_wait_s": round(data_wait_s, 6),
            "samples_per_s": round(samples / step_time_s, 3) if step_time_s > 0 else None,
            "time": time.time(), **({"node": self.node} if self.node is not None else {}),
        }
        if comm_wait_s is not None:
            record["comm_wait_s"] = round(comm_wait_s, 6)
            record["compute_time_s"] = round(max(0.0, step_time_s - data_wait_s - comm_wait_s), 6)
        record.update(extra)
        self._fh.write(json.dumps(record) + "\n")

    def log_link(self, probe: dict[str, Any]) -> None:
        """What :func:`dtrain.training.collectives.probe_links` measured: the transfer into this rank's node
        (a record without a step: the stall report's SlowLink reads it, step readers skip it)."""
        record = {"time": time.time(), **({"node": self.node} if self.node is not None else {})}
        record.update((key, probe[key]) for key in ("link_from_node", "link_bytes", "link_seconds"))
        self._fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._fh.close()


def write_result(result: dict[str, Any], directory: str | None = None) -> str:
    """Atomically write the run's final metrics (rank 0 calls this); the launcher returns them."""
    directory = os.path.abspath(directory or metrics_dir())
    return RunDir(directory).write_json(RESULT, value=result, indent=2)


class HostClock:
    """Step times as host time: true where the step's work runs on the host (CPU training)."""

    #: steps a chunk of metrics holds by default: a loss on the host costs nothing to read, so every
    #: step's line is written as the step ends (a rank killed outright loses none)
    chunk_steps = 1

    def mark(self) -> float:
        return time.perf_counter()

    def times(self, fetch: float, start: float, end: float) -> tuple[float, float]:
        """(step time, data wait) of a step whose marks were taken before fetching its batch, before
        its work and after it."""
        return end - fetch, start - fetch

    def passed(self, mark: float) -> bool:
        return True

    def wait(self, mark: float) -> None:
        pass


class CudaClock:
    """Step times as the GPU sees them: CUDA events recorded on the current stream, read later.

    Host time around asynchronous calls says how fast the host queues work, not how long the GPU
    works or waits. An event records when the stream reaches it, so the data wait is the time the
    GPU sat idle between asking for a batch (the event before the fetch completes once the previous
    step is done) and starting the step; zero while the host keeps ahead. Nothing here waits on
    the device, except :meth:`wait`, which :class:`StepRecorder` calls only on a mark the device
    has long passed.
    """

    #: steps a chunk of metrics holds by default: one host read of the losses per chunk
    chunk_steps = 50

    def __init__(self, device: Any):
        import torch

        self._torch, self.device = torch, device
        self._free: list[Any] = []  # events read and handed back: reused, not created each step

    def mark(self) -> Any:
        event = self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.current_stream(self.device))
        return event

    def times(self, fetch: Any, start: Any, end: Any) -> tuple[float, float]:
        step_s, wait_s = fetch.elapsed_time(end) / 1000.0, fetch.elapsed_time(start) / 1000.0
        self._free.extend((fetch, start, end))
        return step_s, wait_s

    def passed(self, mark: Any) -> bool:
        return mark.query()

    def wait(self, mark: Any) -> None:
        mark.synchronize()


def step_clock(device: Any) -> HostClock | CudaClock:
    """The clock that tells true step times for work on ``device``."""
    return CudaClock(device) if getattr(device, "type", str(device).split(":")[0]) == "cuda" else HostClock()


class _Chunk:
    """Steps whose losses went to the host together: one copy, one read."""

    def __init__(self, steps: list[dict[str, Any]], clock: Any):
        import torch

        tensors = [s["loss"] for s in steps if not isinstance(s["loss"], float)]
        self.steps, self.values, self.done = steps, None, steps[-1]["marks"][-1]
        if tensors:
            stacked = torch.stack([t.reshape(()) for t in tensors]).float()
            if stacked.device.type == "cpu":
                self.values = stacked
            else:  # a copy the host does not wait for; the caching host allocator keeps the buffer
                self.values = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                self.values.copy_(stacked, non_blocking=True)
                self.done = clock.mark()  # reached once the copy is done

    def records(self, clock: Any) -> list[dict[str, Any]]:
        clock.wait(self.done)
        values = iter(self.values.tolist() if self.values is not None else ())
        for step in self.steps:
            if not isinstance(step["loss"], float):
                step["loss"] = next(values)
            step["step_time_s"], step["data_wait_s"] = clock.times(*step.pop("marks"))
        return self.steps


class StepRecorder:
    """The per-step lines of :class:`MetricsWriter`, read from the device without a wait per step.

    Each step hands over its loss (a float, or a tensor on any device) and three clock marks. Every
    ``every`` steps, or once ``max_delay_s`` passed since the chunk began, the chunk's losses are
    stacked and copied to pinned host memory without waiting; a chunk is written once the device
    has passed it (checked without waiting at every step), at the latest when the next chunk is cut.
    So on a GPU the host never waits in steady state, and a loss on the host is read once a chunk.
    ``every`` defaults to the clock's ``chunk_steps``: 50 steps on a GPU, 1 on the host (a host value
    costs nothing to read, and a rank killed outright then loses no line).
    """

    def __init__(self, writer: MetricsWriter, clock: Any, *, every: int | None = None, max_delay_s: float = 1.0):
        every = clock.chunk_steps if every is None else every  # the clock's: 50 on a GPU, 1 on the host
        if every < 1:
            raise ValueError(f"every must be at least 1 step, got {every}")
        self.writer, self.clock, self.every, self.max_delay_s = writer, clock, every, max_delay_s
        self._open: list[dict[str, Any]] = []
        self._opened_at = 0.0
        self._in_flight: deque[_Chunk] = deque()
        self.last_loss = float("nan")  # of the last step written

    def record(self, *, step: int, epoch: int | None, loss: Any, samples: int, marks: tuple,
               comm_wait_s: float | None = None) -> None:
        if not self._open:
            self._opened_at = time.monotonic()
        loss = loss.detach() if hasattr(loss, "detach") else float(loss)  # a tensor stays on its device
        self._open.append({"step": step, "epoch": epoch, "loss": loss, "samples": samples, "marks": marks,
                           "comm_wait_s": comm_wait_s, "time": time.time()})
        if len(self._open) >= self.every or time.monotonic() - self._opened_at >= self.max_delay_s:
            self._cut()
        self._write(lambda chunk: self.clock.passed(chunk.done))

    def flush(self, wait: bool = True) -> None:
        """Write every step recorded so far (waits for the device). ``wait=False`` writes only what the
        device has passed: after a failed collective, work queued behind it may never finish."""
        if self._open:
            self._in_flight.append(_Chunk(self._open, self.clock))
            self._open = []
        self._write(lambda chunk: wait or self.clock.passed(chunk.done))

    def log_link(self, probe: dict[str, Any]) -> None:
        """The link probe's record (:meth:`MetricsWriter.log_link`), after every step recorded so far."""
        self.flush()
        self.writer.log_link(probe)

    def close(self, wait: bool = True) -> None:
        self.flush(wait)
        self.writer.close()

    def _cut(self) -> None:
        self._write(lambda chunk: True)  # the chunk before (cut a chunk ago): at most one in flight after this
        self._in_flight.append(_Chunk(self._open, self.clock))
        self._open = []

    def _write(self, ready: Callable[[_Chunk], bool]) -> None:
        while self._in_flight and ready(self._in_flight[0]):
            for record in self._in_flight.popleft().records(self.clock):
                self.writer.log(**record)
                self.last_loss = record["loss"]
