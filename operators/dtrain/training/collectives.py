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

import os
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


#: bytes each rank receives in one timed transfer of :func:`probe_links`
PROBE_BYTES = 1 << 20
#: timed transfers; the fastest counts (a transfer a busy host delayed once is no slow link)
PROBE_REPEATS = 5
#: no further transfer once the probe has taken this long (at 1 mbit/s one transfer takes 8 s)
PROBE_BUDGET_S = 5.0


def probe_links(device: Any = "cpu", nbytes: int = PROBE_BYTES, repeats: int = PROBE_REPEATS,
                budget_s: float = PROBE_BUDGET_S) -> dict[str, Any] | None:
    """Time what this rank receives from its peer of the same local rank on the previous node, while it
    sends as much to its peer on the next node (every link into a node carries one transfer at a time
    per local rank). A collective: every rank calls it at the same point (after training, say), with the
    same arguments.

    Why: a slow link into one node shows in the all-reduce as every rank waiting, with nobody waited
    for (two nodes' all-reduce crosses their one link both ways), so collective waits cannot say which
    link; per-link transfer times can (the stall report's ``SlowLink``). Record what it returns with
    :meth:`dtrain.training.metrics.MetricsWriter.log_link`. None, on every rank, when there is one node,
    or the nodes hold different numbers of ranks."""
    import torch
    import torch.distributed as dist

    from dtrain.training.metrics import node_index

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    node = node_index()
    mine = torch.tensor([-1 if node is None else node,
                         int(os.environ.get("LOCAL_RANK") or 0)], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    where = [tuple(int(v) for v in t.tolist()) for t in everyone]  # rank -> (node, local rank)
    peers = _ring_peers(where, rank)
    if peers is None:
        return None
    source, target = peers
    send = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    received = torch.empty_like(send)
    best, started = float("inf"), time.monotonic()
    for _ in range(repeats):
        dist.barrier()
        begin = time.perf_counter()
        receive, *sends = dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, source),
                                                  dist.P2POp(dist.isend, send, target)])
        receive.wait()
        if send.is_cuda:
            torch.cuda.synchronize(send.device)
        best = min(best, time.perf_counter() - begin)
        for request in sends:
            request.wait()
        over = torch.tensor([int(time.monotonic() - started > budget_s)], dtype=torch.int64, device=device)
        dist.all_reduce(over, op=dist.ReduceOp.MAX)  # every rank stops after the same transfer
        if over.item():
            break
    return {"link_from_node": where[source][0], "link_bytes": send.numel() * 4, "link_seconds": round(best, 6)}


def _ring_peers(where: list[tuple[int, int]], rank: int) -> tuple[int, int] | None:
    """(the rank this one receives from, the rank it sends to): the ranks of its own local rank on the
    previous and the next node, in node order; None when a node is unknown, there is one node, two ranks
    claim one place, or the nodes hold different local ranks (every rank comes to the same answer)."""
    nodes = sorted({node for node, _ in where})
    if len(nodes) < 2 or nodes[0] < 0 or len(set(where)) != len(where):
        return None
    per_node = {node: sorted(local for n, local in where if n == node) for node in nodes}
    if len({tuple(locals_) for locals_ in per_node.values()}) != 1:
        return None
    by_place = {place: r for r, place in enumerate(where)}
    node, local = where[rank]
    at = nodes.index(node)
    return by_place[(nodes[at - 1], local)], by_place[(nodes[(at + 1) % len(nodes)], local)]
