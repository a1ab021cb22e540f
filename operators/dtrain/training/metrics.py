"""Per-rank metrics as JSON lines, and the run's final result, in the launcher's metrics directory.

Each line of ``rank{R}.jsonl``: step, epoch, loss, samples, step_time_s, data_wait_s,
samples_per_s, time. The data-stall report reads these.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from dtrain.rundir import RESULT, RunDir


def metrics_dir() -> str:
    return os.environ.get("DTRAIN_METRICS_DIR") or os.path.join(os.getcwd(), "metrics")


class MetricsWriter:
    def __init__(self, rank: int, directory: str | None = None):
        self.directory = os.path.abspath(directory or metrics_dir())
        self.path = os.path.join(self.directory, f"rank{rank}.jsonl")
        # never through a link another process of the job planted (dtrain.rundir)
        fd = RunDir(self.directory).open_append(os.path.basename(self.path))
        self._fh = os.fdopen(fd, "a", encoding="utf-8", buffering=1)

    def log(self, *, step: int, loss: float, samples: int, step_time_s: float, data_wait_s: float,
            epoch: int | None = None, **extra: Any) -> None:
        record = {
            "step": step, "epoch": epoch, "loss": float(loss), "samples": samples,
            "step_time_s": round(step_time_s, 6), "data_wait_s": round(data_wait_s, 6),
            "samples_per_s": round(samples / step_time_s, 3) if step_time_s > 0 else None,
            "time": time.time(), **extra,
        }
        self._fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._fh.close()


def write_result(result: dict[str, Any], directory: str | None = None) -> str:
    """Atomically write the run's final metrics (rank 0 calls this); the launcher returns them."""
    directory = os.path.abspath(directory or metrics_dir())
    return RunDir(directory).write_json(RESULT, value=result, indent=2)
