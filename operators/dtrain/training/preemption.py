"""Preemption: on SIGTERM, finish the current step, save a checkpoint, exit 143.

A spot instance's notice, Slurm preemption or ``scancel``, an Airflow stop and
``dtrain launch`` getting SIGTERM all end the same way for a rank: SIGTERM, then,
``stop_grace`` seconds later (the launch spec's field, default 30; exported to the
ranks as ``$DTRAIN_STOP_GRACE``), SIGKILL. Without a handler SIGTERM kills the rank at
once and the retry resumes from the last periodic checkpoint. With a guard::

    from dtrain.training import CheckpointManager, PreemptionGuard, init_distributed

    ctx = init_distributed()
    guard = PreemptionGuard()                 # SIGTERM now only sets a flag
    for batch in loader:
        train_step(batch)
        step += 1
        if ckpt.should_save(step):
            ckpt.save(step, state())
        if guard.should_stop():               # the same answer on every rank, at the same step
            if ckpt.last_saved_step != step:
                ckpt.save(step, state())      # rank 0 writes (DDP); every rank (DeepSpeed)
            sys.exit(guard.exit_code)         # 143 = 128 + SIGTERM

Design:

* The handler only records the request (a Python signal handler runs on the main thread
  between two bytecodes: a step blocked in a C++ collective finishes it first). Nothing
  else happens until the loop asks. Repeated SIGTERMs change nothing: every process of a
  job gets the signal from several senders (the launcher, torchrun, the per-rank wrapper).
* :meth:`PreemptionGuard.should_stop` is a collective when torch.distributed is
  initialized: a MAX all-reduce of the local flag, so every rank stops after the same
  step even when the signal reached them a step apart. That matters: DDP ranks that stop
  at different steps leave one blocked in the next step's all-reduce, and a DeepSpeed
  checkpoint needs every rank. Call it at the same points on every rank (each step, or
  every k steps). The all-reduce is asynchronous and its result is read at the next call:
  the step never waits for it (on NCCL the flag comes back through pinned memory, read a
  step after the device wrote it), and every rank reads the same result at the same call,
  so a stop lands one call after the ranks' flags were sent.
* A rank whose peer is already gone gets an error from the agreement (gloo: the
  connection closed): when a stop was requested here, that counts as "stop" (and
  :attr:`PreemptionGuard.peers_lost` is set), so the rank still exits promptly, without a
  checkpoint (the ranks never agreed on a step), best with :meth:`PreemptionGuard.exit`;
  without a stop request the error is raised (a peer failed: a real failure).
* The C-level handler is installed with SA_RESTART (``signal.siginterrupt(sig, False)``):
  a system call in C++ code (a store or socket read) is restarted, not failed with EINTR.
* SIGTERM only by default: every stop path of the launcher sends SIGTERM. SIGINT keeps
  its KeyboardInterrupt unless ``signals`` includes it.

Stdlib only at import; torch only inside :meth:`PreemptionGuard.should_stop`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Iterable

#: exit status of a rank that stopped on SIGTERM (as a shell reports a process SIGTERM ended)
STOP_EXIT_CODE = 128 + signal.SIGTERM
#: the environment variable in which the launcher tells the ranks their grace period (seconds)
GRACE_ENV = "DTRAIN_STOP_GRACE"

_active: "PreemptionGuard | None" = None


def stop_grace_from_env(environ=None) -> float | None:
    """The grace period the launcher gave this rank (``$DTRAIN_STOP_GRACE``), or None."""
    value = (os.environ if environ is None else environ).get(GRACE_ENV)
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


@dataclass(frozen=True)
class StopRequest:
    """A stop signal this process received: which, when (``time.monotonic()``) and the grace it has."""

    signum: int
    received_at: float
    grace: float | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def time_left(self) -> float | None:
        """Seconds left before the launcher's SIGKILL (None when the grace period is not known)."""
        if self.grace is None:
            return None
        return max(0.0, self.received_at + self.grace - time.monotonic())


class PreemptionGuard:
    """Turn SIGTERM into a request the training loop acts on between two steps.

    Args:
        signals: the signals that request a stop (default SIGTERM).
        sync: agree across ranks in :meth:`should_stop` when torch.distributed is initialized.
        announce: write one line to stderr when the first request arrives.
        install: install the handlers now (else call :meth:`install`, or use ``with``).
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,), *, sync: bool = True, announce: bool = True,
                 install: bool = True):
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("PreemptionGuard needs at least one signal")
        self.sync = sync
        self.announce = announce
        self.request: StopRequest | None = None
        self.peers_lost = False
        self._agreed = False
        self._pending: tuple | None = None  # the all-reduce sent at the last call: (work, flag, host copy, done)
        self._previous: dict[int, object] = {}
        if install:
            self.install()

    # -- handlers ---------------------------------------------------------------------------------

    def install(self) -> "PreemptionGuard":
        global _active
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard must be installed from the main thread (Python runs signal "
                               "handlers there only)")
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._on_signal)
                signal.siginterrupt(signum, False)  # SA_RESTART: C++ code blocked in a syscall is not failed
        _active = self
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back (the request, if any, is kept)."""
        global _active
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if _active is self:
            _active = None

    def __enter__(self) -> "PreemptionGuard":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, _frame=None) -> None:
        # Runs on the main thread between two bytecodes: record, nothing else. os.write, not print:
        # the main thread may be inside a print of its own (a reentrant buffered write raises).
        if self.request is not None:
            return
        self.request = StopRequest(signum=signum, received_at=time.monotonic(), grace=stop_grace_from_env())
        if self.announce:
            grace = "" if self.request.grace is None else f" (grace {self.request.grace:g}s)"
            message = f"[dtrain] {self.request.name} received: stopping after the current step{grace}\n"
            try:
                os.write(2, message.encode())
            except OSError:
                pass

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop from code (what the signal does); e.g. a job's own time budget."""
        self._on_signal(signum)

    # -- what the loop asks -----------------------------------------------------------------------

    def stop_requested(self) -> bool:
        """Whether this process was asked to stop. Local and free: no collective."""
        return self.request is not None

    def should_stop(self) -> bool:
        """Whether to stop now: this process's request, agreed with every rank (a MAX all-reduce)
        when torch.distributed is initialized and ``sync`` is on; the all-reduce sent at one call is
        read at the next, so the answer comes a call after the request. Once True, stays True."""
        if self._agreed:
            return True
        local = self.request is not None
        group = _world() if self.sync else None
        if group is None:
            self._agreed = local
            return local
        import torch.distributed as dist

        try:
            self._agreed = self._read_pending()
            if not self._agreed:
                self._pending = _send_flag(dist, local)
        except Exception:
            if not local:
                raise  # a peer failed while nobody asked to stop: a real failure
            self.peers_lost = True  # a peer already stopped: stop here too, without agreement
            self._agreed = True
            return True
        if self._agreed and self.request is None:  # a peer got the signal first
            self.request = StopRequest(signum=signal.SIGTERM, received_at=time.monotonic(),
                                       grace=stop_grace_from_env())
        return self._agreed

    def _read_pending(self) -> bool:
        """The agreed flag of the all-reduce sent at the last call (False at the first call)."""
        if self._pending is None:
            return False
        work, flag, host, done = self._pending
        self._pending = None
        work.wait()
        if done is not None:  # NCCL: the flag was copied to pinned memory a step ago
            done.synchronize()
            return bool(host[0])
        return bool(flag[0])

    def exit(self) -> None:
        """Exit now with :attr:`exit_code`, skipping the interpreter's teardown: after a peer left
        without agreeing, the process group's C++ destructors may abort (exit 134) instead of
        returning. Output is flushed first; nothing else runs (no atexit, no finally)."""
        import sys

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 (a closed or broken stream must not keep us here)
                pass
        os._exit(self.exit_code)

    @property
    def exit_code(self) -> int:
        """What the process should exit with after stopping: 128 + the signal (143 for SIGTERM)."""
        return 128 + (self.request.signum if self.request is not None else signal.SIGTERM)

    def time_left(self) -> float | None:
        """Seconds left of the grace period (None: no request, or the grace is unknown)."""
        return None if self.request is None else self.request.time_left()


def stop_requested() -> bool:
    """Whether the installed guard (the last one installed in this process) got a stop request."""
    return _active is not None and _active.stop_requested()


def active_guard() -> PreemptionGuard | None:
    return _active


def _world():
    """The default process group when this process is one of several ranks, else None."""
    import sys

    dist_module = sys.modules.get("torch.distributed")
    if dist_module is None:  # torch.distributed never imported: no process group can exist
        return None
    if not (dist_module.is_available() and dist_module.is_initialized()) or dist_module.get_world_size() < 2:
        return None
    return dist_module.group.WORLD


def _send_flag(dist, local: bool) -> tuple:
    """Start the MAX all-reduce of this rank's flag without waiting for it: (work, flag, host copy, done
    event). On NCCL the flag is on the GPU; its copy to pinned memory is queued behind the all-reduce."""
    import torch

    if dist.get_backend() != "nccl":
        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        return dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag, None, None
    device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.full((1,), 1 if local else 0, dtype=torch.int32, device=device)  # a fill: no copy to wait for
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
    work.wait()  # on NCCL: the current stream waits for the all-reduce, the host does not
    host = torch.empty(1, dtype=torch.int32, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return work, flag, host, done


__all__ = ["PreemptionGuard", "StopRequest", "STOP_EXIT_CODE", "GRACE_ENV", "stop_requested", "active_guard",
           "stop_grace_from_env"]
