"""How long a rank waits for its peers in DDP's gradient all-reduce, step by step: what finds a straggler.

    timer = CollectiveTimer.of(ddp_model)      # before the first forward; None when not DDP
    ...
    loss.backward()
    metrics.log(..., comm_wait_s=timer.take() if timer else None)

In synchronous DDP every rank's step takes as long as the slowest rank's: each waits in the
all-reduce, so step times are equal and cannot name a slow rank (the stall report said
``LoadBalancing: ok`` for a host throttled to a quarter of a CPU). What differs is who waits for whom.
So this times the wait: a DDP communication hook (DDP's own all-reduce, wrapped) notes when this
rank's last gradient bucket is ready, which is when its backward is done (it arrives at the all-reduce),
and when that bucket's all-reduce completes. The difference is the step's collective wait: peers
arriving late plus the transfer itself. The all-reduce completes for every rank once the last one
arrived, so across the ranks of one step, a rank arrived as much later than the first as it waited
less: the stall report (:mod:`dtrain.stall_report`) names the rank the others wait for from these
waits alone, step by step, without comparing one host's clock with another's (real hosts' clocks
differ; only the collective is common to them). The step time minus its data wait and this wait is
the rank's own compute time (:class:`dtrain.training.metrics.MetricsWriter` records it as
``compute_time_s``); it is shown, but it does not name a straggler: a host under a CPU quota is stopped
at arbitrary points, inside its all-reduce too, so its compute time understates how late it comes.

Why a comm hook: it measures every step while the job runs, at the cost of two clock reads per
bucket, in the all-reduce DDP does anyway. The flight recorder is read after the fact (and not per
step); timing an explicit barrier would add a collective to every step. The costs: the hook is Python,
so DDP's C++ all-reduce is replaced by the same all-reduce called from Python (one call per bucket,
25 MB by default); a model that already has a comm hook (gradient compression) cannot have this one
(:meth:`CollectiveTimer.of` then returns None and the report falls back to step times); DeepSpeed's
engine has no comm hook (None too).
"""

from __future__ import annotations

import time
from typing import Any


class CollectiveTimer:
    """The collective wait of each step of a DDP model (see the module docstring)."""

    def __init__(self, ddp_model: Any):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._allreduce = allreduce_hook
        self._last: tuple[float, float] | None = None  # (last bucket ready, its all-reduce done)
        ddp_model.register_comm_hook(None, self._hook)

    @classmethod
    def of(cls, model: Any) -> "CollectiveTimer | None":
        """A timer on ``model`` if it is a DDP model that takes one, else None (not DDP: one process, or
        DeepSpeed's engine; DDP with a comm hook already registered)."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            return None
        try:
            return cls(model)
        except RuntimeError:  # "register_comm_hook or register_builtin_comm_hook can only be called once"
            return None

    def _hook(self, state, bucket):  # no annotations: DDP checks them against its own types
        ready = time.perf_counter()
        future = self._allreduce(state, bucket)
        if not bucket.is_last():
            return future

        def done(result: Any) -> Any:  # runs on the process group's thread when the all-reduce completes
            self._last = (ready, time.perf_counter())
            return result.value()

        return future.then(done)

    def take(self) -> float | None:
        """Seconds the last step waited in its gradient all-reduce (call after ``backward()``); None when
        no all-reduce ran since the last call (a ``no_sync`` step of gradient accumulation)."""
        last, self._last = self._last, None
        return None if last is None else max(0.0, last[1] - last[0])
