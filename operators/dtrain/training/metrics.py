"""Per-rank metrics as JSON lines, and the run's final result, in the launcher's metrics directory.

Each line of ``rank{R}.jsonl``: step, epoch, loss, samples, step_time_s, data_wait_s,
samples_per_s, time, the rank's node, and with a collective timer comm_wait_s and compute_time_s.
The stall report reads these.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

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

    def close(self) -> None:
        self._fh.close()


def write_result(result: dict[str, Any], directory: str | None = None) -> str:
    """Atomically write the run's final metrics (rank 0 calls this); the launcher returns them."""
    directory = os.path.abspath(directory or metrics_dir())
    return RunDir(directory).write_json(RESULT, value=result, indent=2)
