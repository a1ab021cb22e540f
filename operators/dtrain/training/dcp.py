"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards.

Layout, under the checkpoint location (a shared-filesystem path or an s3:// prefix)::

    dcp/step-00000100/__0_0.distcp ... __{W-1}_3.distcp   a few files per rank (its shards: dcp_io.THREADS)
    dcp/step-00000100/.metadata                           DCP's index, written by rank 0 after every rank's files
    dcp/step-00000100/dtrain-commit.json                  the commit marker: written last, by rank 0

**Complete or invisible.** A checkpoint counts (is listed, can be "latest") only when its commit
marker exists. DCP's save ends with rank 0 gathering every rank's write results (a barrier: no rank's
result arrives before its files are written, and on the shared filesystem fsynced) and writing
``.metadata``; only when that succeeded does rank 0 write the marker. A kill at any moment (one rank,
every rank, during the asynchronous upload) leaves a folder without a marker, which nothing reads, and
the previous latest stands. Old checkpoints are removed only after a newer one is committed, marker
first, so a removal cut short is invisible too.

**Asynchronous.** ``async_save=True``: :func:`torch.distributed.checkpoint.async_save` copies the
state to host memory (:mod:`dtrain.training.host_buffers`: buffers kept between saves, pinned on CUDA)
and returns; the upload runs in a background thread, on its own gloo process
group (the training's collectives never interleave with the checkpoint's). One save in flight at a
time: the next save, a stop (SIGTERM, :mod:`dtrain.training.preemption`) and the end of training
(:func:`dtrain.training.dist.shutdown`, hence ``exit_now``) wait for it.

**Resharding.** DCP stores each tensor's global shape and which shard holds which part; a load
reads what the current ranks' state dicts ask for, so a checkpoint saved at world size 4 loads at
2 or 8 (FSDP2's DTensors re-split, DDP's replicated tensors read whole). :class:`ModelState` gives
a model and its optimizer the state dict that makes that work (torch's ``get_state_dict``).
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from dtrain.rundir import (DCP_INDEX, DCP_MARKER, STEP_DIR, Committed,  # the format the run directory reads too
                           parse_marker, step_name)

KEEP_BEST = ("min", "max")

#: checkpointers with a save that may still be in flight (dist.shutdown waits for them)
_in_flight: "set[DcpCheckpointer]" = set()


class ModelState:
    """A model (plain, DDP or FSDP2) and its optimizer as one DCP ``Stateful``: the state dicts come from
    torch's ``get_state_dict`` (parameter names without DDP's ``module.`` prefix, FSDP2 shards as
    DTensors, optimizer state keyed by parameter name), so they load at another world size."""

    def __init__(self, model: Any, optimizer: Any = None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])


class DcpCheckpointer:
    """Save and load DCP checkpoints under ``storage`` (:mod:`dtrain.training.ckpt_storage`).

    Every rank calls every method at the same point (they are collectives when torch.distributed is
    initialized). ``keep`` complete checkpoints are kept, newest first, plus the best by the metric
    given to :meth:`save` when ``keep_best`` is "min" or "max".
    """

    def __init__(self, storage: Any, *, keep: int = 2, keep_best: str | None = None, async_save: bool = False,
                 index: Any = None):
        if keep_best not in (None, *KEEP_BEST):
            from dtrain.errors import SpecError

            raise SpecError("keep_best", keep_best, "None, 'min' or 'max'")
        self.storage, self.keep, self.keep_best, self.async_save = storage, keep, keep_best, async_save
        #: where rank 0 lists the complete checkpoints of a remote location for the UI (a local
        #: folder of the run directory: the UI never reads object storage with the deployment's
        #: credentials on a rank's word), or None
        self.index = index
        self._group = None
        self._host = None             # host copies of the state's tensors (kept between saves and loads)
        self._pending = None          # this rank's future of the save in flight
        self._committed = threading.Event()
        self._committed.set()
        self._error: BaseException | None = None

    # -- the process group ------------------------------------------------------------------------

    def _world(self) -> tuple[int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _process_group(self):
        """A gloo group of every rank for the checkpoint's own collectives (made once, collectively):
        an asynchronous save gathers in a background thread while training all-reduces on the main one."""
        import torch.distributed as dist

        if self._group is None and self._world()[1] > 1:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _barrier(self) -> None:
        import torch.distributed as dist

        if self._world()[1] > 1:
            dist.barrier(group=self._process_group())

    # -- save -------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], metric: float | None = None) -> str:
        """Save ``state`` (tensors, plain values, ``Stateful`` objects such as :class:`ModelState`) as
        checkpoint ``step``; committed when every rank's shards are written (later, when asynchronous)."""
        import torch.distributed.checkpoint as dcp

        if metric is not None and not math.isfinite(float(metric)):
            raise ValueError(f"metric={metric!r} must be a finite number")
        self.wait()  # one save in flight at a time
        rank, world = self._world()
        name = step_name(step)
        group = self._process_group()
        if rank == 0:
            self.storage.make_root()
            self._discard(name)  # a save of this step cut short earlier, or one being replaced
        self._barrier()  # nobody writes before the folder is clean
        writer = self.storage.writer(name, self._host_buffers() if self.async_save else None)
        if self.async_save:
            self._save_async(state, writer, rank, step, world, metric)
        else:
            plain = _state_dicts(state)
            if _through_host(plain):  # one fast pinned copy, then the disk at its own speed
                plain = self._host_buffers().stage(plain)
            dcp.save(plain, storage_writer=writer, process_group=group)
            if rank == 0:
                self._commit(step, world, metric)
        return self.storage.path(name)

    def _save_async(self, state: dict[str, Any], writer: Any, rank: int, step: int, world: int,
                    metric: float | None) -> None:
        import torch.distributed.checkpoint as dcp

        from dtrain.training.preemption import stop_requested

        self._committed.clear()
        self._error = None
        future = dcp.async_save(state, storage_writer=writer, process_group=self._process_group())
        self._pending = future
        _in_flight.add(self)
        future.add_done_callback(lambda f: self._finish(f, rank, step, world, metric))
        if stop_requested():  # the process is about to exit: the save must land first
            self.wait()

    def _host_buffers(self):
        """The host copies of the state, kept for every save and load of this checkpointer: a save
        copies into the same (on CUDA pinned) buffers instead of allocating and pinning anew, the
        largest part of a stall otherwise. Reusing them is safe because a save waits for the
        previous one to finish first."""
        if self._host is None:
            from dtrain.training.host_buffers import HostBuffers

            self._host = HostBuffers()
        return self._host

    def _finish(self, future, rank: int, step: int, world: int, metric: float | None) -> None:
        """Runs in the background thread when this rank's asynchronous save ends."""
        try:
            future.result()  # rank 0: raises unless every rank's shards and .metadata are written
            if rank == 0:
                self._commit(step, world, metric)
        except BaseException as e:  # noqa: BLE001 (kept for wait() to raise on the main thread)
            self._error = e
        finally:
            self._committed.set()

    def _commit(self, step: int, world: int, metric: float | None) -> None:
        record = {"step": step, "world_size": world, "time": time.time(), "metric": metric}
        self.storage.write_small(step_name(step), DCP_MARKER, data=json.dumps(record).encode())
        self.prune()
        if self.index is not None:
            self._write_index()

    def _write_index(self) -> None:
        entries = [{"step": c.step, "world_size": c.world_size, "time": c.time, "metric": c.metric,
                    "size_bytes": self.storage.size(c.name)} for c in self.committed()]
        self.index.make_root()
        self.index.write_small(DCP_INDEX, data=json.dumps({"location": self.storage.root, "checkpoints": entries}).encode())

    def in_flight(self) -> bool:
        """Whether an asynchronous save is still being written (not committed yet)."""
        return self._pending is not None and not self._committed.is_set()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed; raise its error."""
        if self._pending is None:
            return
        future, self._pending = self._pending, None
        try:
            future.exception()  # wait for the write itself; its outcome is read in _finish
            self._committed.wait()
        finally:
            _in_flight.discard(self)
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint save to {self.storage} failed: {error}") from error

    # -- list, load, prune ------------------------------------------------------------------------

    def committed(self) -> list[Committed]:
        """Complete checkpoints, oldest step first."""
        found = []
        for name in self.storage.names():
            if STEP_DIR.fullmatch(name):
                marker = parse_marker(name, self.storage.read_small(name, DCP_MARKER))
                if marker is not None:
                    found.append(marker)
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Committed | None:
        found = self.committed()
        return found[-1] if found else None

    def load(self, state: dict[str, Any]) -> Committed | None:
        """Load the latest complete checkpoint into ``state`` in place (resharded to this world);
        None when there is none. Rank 0 chooses it, so every rank loads the same one."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.wait()
        chosen = [self.latest() if self._world()[0] == 0 else None]
        if self._world()[1] > 1:
            dist.broadcast_object_list(chosen, src=0, group=self._process_group())
        if chosen[0] is None:
            return None
        reader = self.storage.reader(chosen[0].name)
        plain = _state_dicts(state)
        if _through_host(plain):  # the disk into pinned host memory, then one fast copy to the devices
            mirrored = self._host_buffers().mirror(plain)
            dcp.load(mirrored, storage_reader=reader, process_group=self._process_group())
            self._host_buffers().restore(plain, mirrored)
        else:
            dcp.load(plain, storage_reader=reader, process_group=self._process_group())
        _load_state_dicts(state, plain)
        return chosen[0]

    def prune(self) -> None:
        """Remove complete checkpoints beyond ``keep`` (and the best), and folders of saves that never
        completed and are older than the newest complete one. Markers go first."""
        found = self.committed()
        if not found:
            return
        kept = {c.step for c in found[-self.keep:]}
        scored = [c for c in found if c.metric is not None]
        if self.keep_best and scored:
            pick = min if self.keep_best == "min" else max
            kept.add(pick(scored, key=lambda c: c.metric).step)
        complete = {c.step for c in found}
        for name in self.storage.names():
            match = STEP_DIR.fullmatch(name)
            if match is None:
                continue
            step = int(match.group(1))
            if step in kept or (step not in complete and step > found[-1].step):
                continue  # kept, or a save still to come (never touched here)
            self._discard(name)

    def _discard(self, name: str) -> None:
        self.storage.remove_file(name, DCP_MARKER)  # invisible first
        self.storage.remove_tree(name)


def _state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each ``Stateful`` (a :class:`ModelState`, a sampler) replaced by its state dict,
    as DCP does before it saves or loads."""
    from torch.distributed.checkpoint.stateful import Stateful

    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _load_state_dicts(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Hand each ``Stateful`` of ``state`` its loaded state dict; other values are replaced in place."""
    from torch.distributed.checkpoint.stateful import Stateful

    for key, value in state.items():
        if isinstance(value, Stateful):
            value.load_state_dict(loaded[key])
        else:
            state[key] = loaded[key]


def _through_host(state: Any) -> bool:
    """Whether a synchronous save or a load goes through the kept host buffers: when the state holds
    CUDA tensors. (DCP's own path copies them to pageable memory one at a time, at a fraction of the
    bus's speed; a CPU-only state is read and written where it lies.)"""
    from dtrain.training.host_buffers import cuda_devices

    return bool(cuda_devices(state))


def wait_all() -> None:
    """Wait for every checkpoint save in flight in this process (before its process groups go)."""
    for checkpointer in list(_in_flight):
        checkpointer.wait()
