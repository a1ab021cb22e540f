"""The async trigger a deferred training task waits on: it polls a submitted job until it ends.

It only polls: ``scontrol show job`` through an asyncio subprocess (``sacct`` when Slurm
has forgotten the job and accounting exists; the exit record the batch script writes
into the run directory either way). Its state lives in Slurm, not in the trigger, so
the kwargs are primitives (job id, backend, run dir, poll interval) and a trigger
rebuilt from :meth:`serialize` after a triggerer restart re-attaches to the same job.

The event payload: ``status`` (``success`` | ``failed`` | ``error``), ``backend``,
``job_id``, ``run_dir``, ``state``, ``exit_code``, ``reason`` and ``tail`` (the last
lines of the job's output file).

``on_kill`` (a user marked the deferred task failed/success or cleared it) cancels the
job with ``scancel``; a triggerer restart does not call it, so the job keeps running.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators.errors import DTrainError
from operators.launch.backends import slurm

SUPPORTED_BACKENDS = ("slurm",)
EVENT_STATUSES = ("success", "failed", "error")
# Consecutive failed polls (scontrol not answering) before the trigger gives up with an error event.
MAX_POLL_ERRORS = 5


async def _run(argv: list[str], timeout: float = 60.0) -> tuple[int, str, str]:
    """Run a Slurm client command without blocking the triggerer's event loop."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    except FileNotFoundError as e:
        raise DTrainError(f"{argv[0]} not found on the triggerer: install the Slurm client commands") from e
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


async def query_slurm_job(job_id: str, run_dir: str) -> slurm.JobStatus:
    """Async twin of :func:`operators.launch.backends.slurm.query` (same argv, same decision)."""
    try:
        rc, out, _ = await _run(slurm.show_job_argv(job_id))
    except asyncio.TimeoutError as e:
        raise DTrainError(f"scontrol show job {job_id} timed out") from e
    fields = slurm.parse_scontrol_job(out) if rc == 0 else {}
    if not fields.get("JobState") and shutil.which("sacct"):
        try:
            rc, out, _ = await _run(slurm.sacct_argv(job_id))
            fields = slurm.parse_sacct(out) if rc == 0 else {}
        except (asyncio.TimeoutError, DTrainError):
            fields = {}
    return slurm.decide(job_id, fields, slurm.read_exit_record(run_dir, job_id))


def event_payload(backend: str, run_dir: str, status: slurm.JobStatus, tail_lines: int = slurm.TAIL_LINES) -> dict[str, Any]:
    """Primitives only: what the task gets back when it resumes."""
    return {
        "status": "success" if status.ok else "failed",
        "backend": backend,
        "job_id": status.job_id,
        "run_dir": run_dir,
        "state": status.state,
        "exit_code": status.exit_code,
        "reason": status.reason,
        "tail": slurm.read_tail(slurm.log_path(run_dir, status.job_id), tail_lines),
    }


class DistributedJobTrigger(BaseTrigger):
    """Poll a submitted training job (``backend='slurm'``) every ``poll_interval`` seconds."""

    def __init__(self, job_id: str, run_dir: str, backend: str = "slurm", poll_interval: float = 10.0):
        super().__init__()
        if backend not in SUPPORTED_BACKENDS:
            raise DTrainError(f"backend={backend!r} cannot be deferred: one of {', '.join(SUPPORTED_BACKENDS)}")
        job_id = str(job_id)
        if not job_id.isdigit():
            raise DTrainError(f"job_id={job_id!r} is not a Slurm job id")
        self.job_id = job_id
        self.run_dir = str(run_dir)
        self.backend = backend
        self.poll_interval = float(poll_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"job_id": self.job_id, "run_dir": self.run_dir, "backend": self.backend,
             "poll_interval": self.poll_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        errors = 0
        while True:
            try:
                status = await query_slurm_job(self.job_id, self.run_dir)
                errors = 0
            except DTrainError as e:
                errors += 1
                self.log.warning("polling %s job %s failed (%d/%d): %s", self.backend, self.job_id, errors,
                                 MAX_POLL_ERRORS, e)
                if errors >= MAX_POLL_ERRORS:
                    yield TriggerEvent({"status": "error", "backend": self.backend, "job_id": self.job_id,
                                        "run_dir": self.run_dir, "state": "UNKNOWN", "exit_code": None,
                                        "reason": str(e), "tail": []})
                    return
            else:
                if status.done:
                    yield TriggerEvent(event_payload(self.backend, self.run_dir, status))
                    return
                self.log.debug("%s job %s is %s", self.backend, self.job_id, status.state)
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        # Only a user's action on the deferred task gets here (not a triggerer restart).
        rc, _, err = await _run(slurm.cancel_argv(self.job_id))
        if rc != 0:
            self.log.warning("scancel %s: %s", self.job_id, err.strip())
