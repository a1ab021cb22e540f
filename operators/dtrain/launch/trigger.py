"""The async trigger a deferred training task waits on: it polls a submitted job until it ends.

Generic over backends: it rebuilds the :class:`~dtrain.launch.backends.JobHandle` from its
kwargs (primitives only) and asks the handle's backend, through the registry, with
``async_poll`` (``scontrol`` for Slurm, ``detached_node status`` over ssh for SSH...). The
job's state lives in the backend, not in the trigger, so a trigger rebuilt from
:meth:`serialize` after a triggerer restart re-attaches to the same job.

The event payload (:func:`event_payload`): ``status``
(``success`` | ``failed`` | ``error``), ``handle``, ``state``, ``exit_code``,
``failed_node``, ``reason`` and ``tail`` (the last lines of the job's output).

``on_kill`` (a user marked the deferred task failed/success or cleared it) cancels the job
on every host; a triggerer restart does not call it, so the job keeps running.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Mapping

from airflow.triggers.base import BaseTrigger, TriggerEvent

from dtrain.errors import DTrainError
from dtrain.launch.backends import JobHandle, JobStatus, get_backend_class
from dtrain.launch.backends.base import MAX_POLL_ERRORS


def event_payload(handle: JobHandle, status: JobStatus) -> dict[str, Any]:
    """Primitives only: what the task gets back when it resumes."""
    return {"status": "success" if status.ok else "failed", "handle": handle.to_dict(), "state": status.state,
            "exit_code": status.exit_code, "failed_node": status.failed_node, "reason": status.reason,
            "tail": [str(line) for line in status.tail]}


def error_payload(handle: JobHandle, reason: str) -> dict[str, Any]:
    return {"status": "error", "handle": handle.to_dict(), "state": "UNKNOWN", "exit_code": None,
            "failed_node": None, "reason": reason, "tail": []}


class DistributedJobTrigger(BaseTrigger):
    """Poll a submitted training job (any backend with detached jobs) every ``poll_interval`` seconds."""

    def __init__(self, handle: Mapping[str, Any], poll_interval: float = 10.0):
        super().__init__()
        self.handle = JobHandle.from_dict(handle)
        backend_cls = get_backend_class(self.handle.backend)
        if not backend_cls.supports_detached:
            raise DTrainError(f"backend={self.handle.backend!r} jobs do not outlive their submitter: cannot be deferred")
        self.poll_interval = float(poll_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"handle": self.handle.to_dict(), "poll_interval": self.poll_interval})

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
        try:
            return asyncio.run(self._poll())
        except DTrainError:
            return None  # unknown yet: the trigger keeps asking

    async def run(self) -> AsyncIterator[TriggerEvent]:
        errors = 0
        while True:
            try:
                payload = await self._poll()
                errors = 0
            except DTrainError as e:
                errors += 1
                self.log.warning("polling %s job %s failed (%d/%d): %s", self.handle.backend,
                                 self.handle.backend_job_id, errors, MAX_POLL_ERRORS, e)
                if errors >= MAX_POLL_ERRORS:
                    yield TriggerEvent(error_payload(self.handle, str(e)))
                    return
            else:
                if payload is not None:
                    yield TriggerEvent(payload)
                    return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        # Only a user's action on the deferred task gets here (not a triggerer restart).
        await self._backend().async_cancel(self.handle)
