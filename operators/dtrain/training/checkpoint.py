"""Atomic checkpoints every N steps, and resume from the latest one.

A checkpoint is written to a hidden temp file in the checkpoint directory, fsynced,
then renamed; the ``latest`` pointer is replaced last. A kill at any moment leaves
either the previous checkpoint or the new one, never a half-written file that a
resume would trust. An Airflow retry or a torchrun restart resumes from ``latest``.
A stop (SIGTERM: :mod:`dtrain.training.preemption`) saves one more, for the step it stopped
at, unless :attr:`CheckpointManager.last_saved_step` says that step was just saved.

``format="dcp"``: sharded checkpoints with torch.distributed.checkpoint, written by every rank,
optionally asynchronous, to the shared filesystem or s3://, resharded on load
(:mod:`dtrain.training.dcp`; docs/checkpoints.md says when to use which).
"""

from __future__ import annotations

import os
import re
from typing import Any

from dtrain.atomic import atomic_open, atomic_write_bytes

LATEST = "latest"
PATTERN = re.compile(r"^step-(\d{8})\.pt$")


def checkpoint_dir() -> str:
    return os.environ.get("DTRAIN_CHECKPOINT_DIR") or os.path.join(os.getcwd(), "checkpoints")


FORMATS = ("torch", "dcp")


class CheckpointManager:
    """Args:
        directory: where checkpoints live (default ``$DTRAIN_CHECKPOINT_DIR``); with ``format="dcp"``
            also ``s3://bucket/prefix``.
        every_n_steps: save when ``step % every_n_steps == 0``.
        keep: how many recent checkpoints to keep.
        rank: with ``format="torch"`` only rank 0 writes (DDP replicas are identical).
        format: ``"torch"`` (one ``torch.save`` file from rank 0) or ``"dcp"`` (every rank writes its
            shards: FSDP2, DDP or plain state dicts; call ``save``/``load_latest`` on every rank).
        async_save: (dcp) return once the state is copied to host memory; the write goes on behind.
        keep_best: (dcp) also keep the best checkpoint by ``save(..., metric=)``: "min" or "max".
        storage_options: (dcp, s3://) s3fs options; default: credentials from the environment.
    """

    def __init__(self, directory: str | None = None, every_n_steps: int = 50, keep: int = 2, rank: int = 0, *,
                 format: str = "torch", async_save: bool = False, keep_best: str | None = None,
                 storage_options: dict[str, Any] | None = None):
        if every_n_steps < 1 or keep < 1:
            raise ValueError(f"every_n_steps={every_n_steps} and keep={keep} must be at least 1")
        if format not in FORMATS or (format == "torch" and (async_save or keep_best)):
            from dtrain.errors import SpecError

            raise SpecError("format", format, f"one of {FORMATS}; async_save and keep_best need 'dcp'")
        self.directory = directory or checkpoint_dir()
        self.every_n_steps = every_n_steps
        self.keep = keep
        self.rank = rank
        #: the step of the last save() / save_deepspeed() this process made (None: none yet)
        self.last_saved_step: int | None = None
        self._dcp = None
        self._host = None
        if format == "dcp":
            from dtrain.training.ckpt_storage import LocalStorage, open_storage
            from dtrain.rundir import DCP_FOLDER
            from dtrain.training.dcp import DcpCheckpointer

            storage = open_storage(f"{self.directory.rstrip('/')}/{DCP_FOLDER}", storage_options)
            # A remote location is listed for the UI in the run directory's checkpoints folder.
            run_folder = os.environ.get("DTRAIN_CHECKPOINT_DIR")
            index = LocalStorage(run_folder) if run_folder and not isinstance(storage, LocalStorage) else None
            self._dcp = DcpCheckpointer(storage, keep=keep, keep_best=keep_best, async_save=async_save, index=index)
        else:
            os.makedirs(self.directory, exist_ok=True)

    @property
    def format(self) -> str:
        return "torch" if self._dcp is None else "dcp"

    def should_save(self, step: int) -> bool:
        return step > 0 and step % self.every_n_steps == 0

    def save(self, step: int, state: dict[str, Any], metric: float | None = None) -> str | None:
        """Write ``state`` for ``step`` (rank 0 only) and move the ``latest`` pointer to it.
        dcp: every rank writes its shards of ``state`` (``metric`` ranks it for ``keep_best``)."""
        if self._dcp is not None:
            path = self._dcp.save(step, state, metric)
            self.last_saved_step = step
            return path
        if self.rank != 0:
            self.last_saved_step = step  # on every rank: the step the job's checkpoint covers
            return None
        import torch

        from dtrain.training.dcp_io import crc32_off
        from dtrain.training.host_buffers import cuda_devices

        name = f"step-{step:08d}.pt"
        path = os.path.join(self.directory, name)
        record = {"step": step, **state}
        if cuda_devices(record):  # one pinned copy of everything, not a pageable copy per tensor
            record = self._host_buffers().stage(record)
        # The training loop waits on this: one fsync per file and none of the folder. mode 0o666 is
        # what a plain open() asks for: the umask decides. torch.load never checks the checksum, so
        # computing it is pure cost (crc32_off).
        with atomic_open(path, mode=0o666, fsync_dir=False) as fh, crc32_off():
            torch.save(record, fh)
        atomic_write_bytes(os.path.join(self.directory, LATEST), f"{name}\n".encode(), mode=0o666, fsync_dir=False)
        self._prune()
        self.last_saved_step = step
        return path

    def _host_buffers(self):
        """(torch) Host copies of the state's CUDA tensors, kept between saves."""
        if self._host is None:
            from dtrain.training.host_buffers import HostBuffers

            self._host = HostBuffers()
        return self._host

    def wait(self) -> None:
        """(dcp) Block until an asynchronous save in flight is complete; raise if it failed."""
        if self._dcp is not None:
            self._dcp.wait()

    def save_in_flight(self) -> bool:
        """(dcp) Whether an asynchronous save is still being written; training may go on meanwhile."""
        return self._dcp is not None and self._dcp.in_flight()

    def steps(self) -> list[int]:
        if self._dcp is not None:
            return [c.step for c in self._dcp.committed()]
        found = []
        for name in os.listdir(self.directory):
            match = PATTERN.match(name)
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def latest_path(self) -> str | None:
        if self._dcp is not None:
            latest = self._dcp.latest()
            return None if latest is None else self._dcp.storage.path(latest.name)
        pointer = os.path.join(self.directory, LATEST)
        try:
            with open(pointer, encoding="utf-8") as fh:
                name = fh.read().strip()
            if PATTERN.match(name) and os.path.isfile(os.path.join(self.directory, name)):
                return os.path.join(self.directory, name)
        except OSError:
            pass
        steps = self.steps()
        return os.path.join(self.directory, f"step-{steps[-1]:08d}.pt") if steps else None

    def load_latest(self, map_location: str = "cpu", into: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The latest checkpoint's state (with its ``step``), or None when there is none.
        dcp: loads in place into ``into`` (the same keys and objects as saved, in this world's
        shapes: DCP reshards), and returns it with ``step``."""
        if self._dcp is not None:
            if into is None:
                raise ValueError("format='dcp' loads in place: pass into= (the state dict to fill)")
            found = self._dcp.load(into)
            if found is None:
                return None
            self.last_saved_step = found.step
            return {**into, "step": found.step}
        path = self.latest_path()
        if path is None:
            return None
        import torch

        return torch.load(path, map_location=map_location, weights_only=False)

    def _prune(self) -> None:
        for step in self.steps()[:-self.keep]:
            try:
                os.unlink(os.path.join(self.directory, f"step-{step:08d}.pt"))
            except FileNotFoundError:
                pass

    # DeepSpeed engines shard optimizer state across ranks: every rank saves its part,
    # and DeepSpeed writes its own "latest" tag file after all shards are written.
    def save_deepspeed(self, engine, step: int, client_state: dict[str, Any] | None = None) -> None:
        engine.save_checkpoint(os.path.join(self.directory, "deepspeed"), tag=f"step-{step:08d}",
                               client_state={"step": step, **(client_state or {})})
        self.last_saved_step = step

    def load_deepspeed(self, engine) -> dict[str, Any] | None:
        ds_dir = os.path.join(self.directory, "deepspeed")
        if not os.path.isfile(os.path.join(ds_dir, LATEST)):
            return None
        path, client_state = engine.load_checkpoint(ds_dir)
        return client_state if path is not None else None
