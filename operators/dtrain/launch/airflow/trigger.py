"""The async trigger a deferred training task waits on: it polls a submitted job until it ends.

Generic over backends: it rebuilds the :class:`~dtrain.launch.backends.JobHandle` from its
kwargs (primitives only) and asks the handle's backend, through the registry, with
``async_poll`` (``scontrol`` for Slurm, ``detached_node status`` over ssh for SSH...). The
job's state lives in the backend, not in the trigger, so a trigger rebuilt from
:meth:`serialize` after a triggerer restart re-attaches to the same job.

The event payload (:func:`event_payload`): ``status``
(``success`` | ``failed`` | ``error`` | ``hung``), ``handle``, ``state``, ``exit_code``,
``failed_node``, ``reason`` and ``tail`` (the last lines of the job's output); a ``hung``
event also carries ``hang``, the :class:`~dtrain.launch.engine.hang.HangVerdict` as primitives.

With ``hang_timeout`` the trigger also watches the ranks' progress between polls (files in
the run directory, see :mod:`dtrain.launch.engine.hang`): a hung job gets its stacks dumped and is
cancelled by the trigger, which then reports it.

``on_kill`` (a user marked the deferred task failed/success or cleared it) cancels the job
on every host; a triggerer restart does not call it, so the job keeps running.

A job must never run on unwatched: when polling keeps failing (the backend cannot be asked,
:data:`MAX_POLL_ERRORS` times in a row) or fails in a way nobody planned for (a bug, an answer
that cannot be read), the trigger cancels the job and reports an ``error`` event.

The handle in the kwargs may hold a per-job secret (``data["secret"]``: the SSH daemons' records
are signed with it). Airflow keeps trigger kwargs encrypted (Fernet) in its metadata database and
the REST API does not show them; events and this trigger's repr are logged, so they carry the
handle's public form (:meth:`JobHandle.public`: the secret's digest only).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Mapping

from airflow.triggers.base import BaseTrigger, TriggerEvent

from dtrain.errors import DTrainError
from dtrain.launch.backends import JobHandle, JobStatus, get_backend_class
from dtrain.launch.backends.base import MAX_POLL_ERRORS
from dtrain.launch.backends.base import STUCK_GRACE_S
from dtrain.launch.engine import hang


def event_payload(handle: JobHandle, status: JobStatus) -> dict[str, Any]:
    """Primitives only: what the task gets back when it resumes."""
    return {"status": "success" if status.ok else "failed", "handle": handle.public(), "state": status.state,
            "exit_code": status.exit_code, "failed_node": status.failed_node, "reason": status.reason,
            "tail": [str(line) for line in status.tail], "lost": dict(status.lost) if status.lost else None}


def hung_payload(handle: JobHandle, verdict: hang.HangVerdict) -> dict[str, Any]:
    return {"status": "hung", "handle": handle.public(), "state": "HUNG", "exit_code": hang.HANG_EXIT_CODE,
            "failed_node": None, "reason": verdict.message(), "tail": [], "hang": verdict.to_dict()}


def error_payload(handle: JobHandle, reason: str) -> dict[str, Any]:
    return {"status": "error", "handle": handle.public(), "state": "UNKNOWN", "exit_code": None,
            "failed_node": None, "reason": reason, "tail": []}


BACKOFF = 1.5  # each poll that finds the job running waits this much longer, up to max_poll_interval


def next_interval(current: float, maximum: float | None) -> float:
    """The wait after ``current``: half as long again, capped at ``maximum`` (None: no backoff)."""
    if maximum is None or current >= maximum:
        return current
    return min(current * BACKOFF, maximum)


class DistributedJobTrigger(BaseTrigger):
    """Poll a submitted training job (any backend with detached jobs) until it ends.

    The first wait is ``poll_interval`` seconds; each poll that finds the job running waits half
    as long again, up to ``max_poll_interval`` (None: every wait is ``poll_interval``). A
    many-hour job is then asked a few times a minute, a short one still ends promptly.
    """

    def __init__(self, handle: Mapping[str, Any], poll_interval: float = 10.0, hang_timeout: float | None = None,
                 max_poll_interval: float | None = None):
        super().__init__()
        self.handle = JobHandle.from_dict(handle)
        backend_cls = get_backend_class(self.handle.backend)
        if not backend_cls.supports_detached:
            raise DTrainError(f"backend={self.handle.backend!r} jobs do not outlive their submitter: cannot be deferred")
        self.poll_interval = float(poll_interval)
        self.hang_timeout = None if hang_timeout is None else float(hang_timeout)
        self.max_poll_interval = None if max_poll_interval is None else float(max_poll_interval)
        self._errors = 0  # polls in a row that could not reach the backend

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"handle": self.handle.to_dict(), "poll_interval": self.poll_interval,
                 "hang_timeout": self.hang_timeout, "max_poll_interval": self.max_poll_interval})

    def __repr__(self) -> str:  # Airflow logs triggers: never with the secret
        return self.repr(self.serialize()[0], {"handle": self.handle.public()})

    def _backend(self):
        return get_backend_class(self.handle.backend)(sink=self.log.info)

    async def _poll(self) -> dict[str, Any] | None:
        """The event payload if the job ended, else None. Raises DTrainError when the backend cannot be asked."""
        status = await self._backend().async_poll(self.handle)
        if not status.reachable:
            raise DTrainError(status.reason or "the backend did not answer")
        return event_payload(self.handle, status) if status.done else None

    def poll_once(self) -> dict[str, Any] | None:
        """One synchronous poll, for the operator's check before it defers (no event loop there)."""
        return asyncio.run(self._guarded(self._poll_or_none))

    async def _poll_or_none(self) -> dict[str, Any] | None:
        try:
            return await self._poll()
        except DTrainError:
            return None  # unknown yet: the trigger keeps asking

    async def _guarded(self, step) -> dict[str, Any] | None:
        """``step()``; if it raises anything else than a backend that cannot be asked (a bug, an
        answer nobody planned for), the job is cancelled, since nobody would watch it any more."""
        try:
            return await step()
        except Exception as e:
            self.log.exception("watching %s job %s failed", self.handle.backend, self.handle.backend_job_id)
            return await self._abandon(f"watching the job failed: {type(e).__name__}: {e}")

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self._errors = 0
        interval = self.poll_interval
        while True:
            payload = await self._guarded(self._step)
            if payload is not None:
                yield TriggerEvent(payload)
                return
            await asyncio.sleep(interval if self.hang_timeout is None
                                else min(interval, hang.poll_interval(self.hang_timeout)))
            interval = next_interval(interval, self.max_poll_interval)

    async def _step(self) -> dict[str, Any] | None:
        """One poll and one hang check: the event payload when the watch is over, else None."""
        try:
            payload = await self._poll()
            self._errors = 0
        except DTrainError as e:
            self._errors += 1
            self.log.warning("polling %s job %s failed (%d/%d): %s", self.handle.backend,
                             self.handle.backend_job_id, self._errors, MAX_POLL_ERRORS, e)
            if self._errors >= MAX_POLL_ERRORS:
                return await self._abandon(str(e))
        else:
            if payload is not None:
                return payload
        verdict = await self._hang_verdict()
        if verdict is not None:
            await self._backend().async_cancel(self.handle, STUCK_GRACE_S)
            return hung_payload(self.handle, verdict)
        return None

    async def _abandon(self, reason: str) -> dict[str, Any]:
        """Cancel the job (nobody would watch it any more) and return the error event's payload."""
        self.log.error("giving up on %s job %s: %s; cancelling it", self.handle.backend,
                       self.handle.backend_job_id, reason)
        try:
            await self._backend().async_cancel(self.handle)
        except Exception as e:  # still report: the task then fails and its cancel tries again
            self.log.exception("cancelling %s job %s failed", self.handle.backend, self.handle.backend_job_id)
            reason += f"; cancelling it failed too: {type(e).__name__}: {e}"
        return error_payload(self.handle, reason)

    async def _hang_verdict(self) -> hang.HangVerdict | None:
        """With hang_timeout: the verdict once a rank has been silent that long (its stacks
        collected first), else None. Progress is read from files: cheap enough for the loop."""
        if self.hang_timeout is None:
            return None
        detector = hang.HangDetector(self.handle.run_dir, self.handle.world_size, self.hang_timeout,
                                     since=self.handle.submitted_at)
        sequence = hang.hang_sequence(detector, lambda level, message: getattr(self.log, level)("%s", message),
                                      hang.DUMP_WAIT_S)
        try:
            while True:
                await asyncio.sleep(next(sequence))
        except StopIteration as ended:
            return ended.value

    async def on_kill(self) -> None:
        # Only a user's action on the deferred task gets here (not a triggerer restart).
        await self._backend().async_cancel(self.handle)
