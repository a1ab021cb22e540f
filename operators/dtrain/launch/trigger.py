"""The async trigger a deferred training task waits on: it polls a submitted job until it ends.

It only polls, through asyncio subprocesses:

* ``slurm``: ``scontrol show job`` (``sacct`` when Slurm has forgotten the job and
  accounting exists; the exit record the batch script writes into the run directory
  either way);
* ``ssh``: ``python -m operators.launch.detached_node status`` on every host over ssh.

The job's state lives in Slurm or on the hosts, not in the trigger, so the kwargs are
primitives (job id, backend, run dir, poll interval; for ssh the hostfile lines and the
SSH settings dict) and a trigger rebuilt from :meth:`serialize` after a triggerer restart
re-attaches to the same job.

The event payload: ``status`` (``success`` | ``failed`` | ``error``), ``backend``,
``job_id``, ``run_dir``, ``state``, ``exit_code``, ``reason`` and ``tail`` (the last
lines of the job's output: the Slurm output file, or the failing host's node log).

``on_kill`` (a user marked the deferred task failed/success or cleared it) cancels the
job (``scancel``, or ``detached_node stop`` on every host); a triggerer restart does not
call it, so the job keeps running.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators.errors import DTrainError
from operators.launch.backends import slurm

SUPPORTED_BACKENDS = ("slurm", "ssh")
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
        rc, out, err = await _run(slurm.show_job_argv(job_id))
    except asyncio.TimeoutError as e:
        raise DTrainError(f"scontrol show job {job_id} timed out") from e
    fields = slurm.fields_or_raise(job_id, rc, out, err)
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


def ssh_payload(job_id: str, run_dir: str, status) -> dict[str, Any]:
    return {"status": "success" if status.ok else "failed", "backend": "ssh", "job_id": job_id, "run_dir": run_dir,
            "state": status.state, "exit_code": status.exit_code,
            "reason": "" if status.failed_node is None else f"node {status.failed_node}", "tail": list(status.tail)}


async def query_ssh_job(target, run_dir: str):
    """Async twin of :func:`operators.launch.ssh_deferred.query_job`: every host polled at once."""
    from operators.launch import ssh_deferred

    timeout = target.settings().connect_timeout + 30

    async def one(argv):
        try:
            return await _run(argv, timeout)
        except asyncio.TimeoutError:
            return 255, "", f"timed out after {timeout}s"

    results = await asyncio.gather(*(one(argv) for argv in ssh_deferred.status_argvs(target, run_dir)))
    return ssh_deferred.decide([ssh_deferred.parse_status(i, *r) for i, r in enumerate(results)])


class DistributedJobTrigger(BaseTrigger):
    """Poll a submitted training job (``backend`` ``slurm`` or ``ssh``) every ``poll_interval`` seconds."""

    def __init__(self, job_id: str, run_dir: str, backend: str = "slurm", poll_interval: float = 10.0,
                 hosts: list[str] | None = None, ssh: dict[str, Any] | None = None):
        super().__init__()
        if backend not in SUPPORTED_BACKENDS:
            raise DTrainError(f"backend={backend!r} cannot be deferred: one of {', '.join(SUPPORTED_BACKENDS)}")
        job_id = str(job_id)
        if backend == "slurm" and not job_id.isdigit():
            raise DTrainError(f"job_id={job_id!r} is not a Slurm job id")
        if backend == "ssh" and not hosts:
            raise DTrainError("backend='ssh' needs the hosts (hostfile lines) to poll")
        self.job_id = job_id
        self.run_dir = str(run_dir)
        self.backend = backend
        self.poll_interval = float(poll_interval)
        self.hosts = [str(h) for h in hosts] if hosts else None
        self.ssh = {str(k): v for k, v in (ssh or {}).items()} if backend == "ssh" else None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs: dict[str, Any] = {"job_id": self.job_id, "run_dir": self.run_dir, "backend": self.backend,
                                  "poll_interval": self.poll_interval}
        if self.backend == "ssh":
            kwargs.update(hosts=list(self.hosts), ssh=dict(self.ssh))
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    def _target(self):
        from operators.launch.ssh_deferred import Target

        return Target(hosts=tuple(self.hosts), ssh=dict(self.ssh))

    async def _poll(self) -> dict[str, Any] | None:
        """The event payload if the job ended, else None. Raises DTrainError when the backend cannot be asked."""
        if self.backend == "slurm":
            status = await query_slurm_job(self.job_id, self.run_dir)
            return event_payload(self.backend, self.run_dir, status) if status.done else None
        status = await query_ssh_job(self._target(), self.run_dir)
        if status.unreachable:
            raise DTrainError("; ".join(status.tail) or "a host did not answer")
        return ssh_payload(self.job_id, self.run_dir, status) if status.done else None

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
                self.log.warning("polling %s job %s failed (%d/%d): %s", self.backend, self.job_id, errors,
                                 MAX_POLL_ERRORS, e)
                if errors >= MAX_POLL_ERRORS:
                    yield TriggerEvent({"status": "error", "backend": self.backend, "job_id": self.job_id,
                                        "run_dir": self.run_dir, "state": "UNKNOWN", "exit_code": None,
                                        "reason": str(e), "tail": []})
                    return
            else:
                if payload is not None:
                    yield TriggerEvent(payload)
                    return
            await asyncio.sleep(self.poll_interval)

    async def on_kill(self) -> None:
        # Only a user's action on the deferred task gets here (not a triggerer restart).
        if self.backend == "slurm":
            argvs = [slurm.cancel_argv(self.job_id)]
        else:
            from operators.launch.ssh_deferred import stop_argvs

            argvs = stop_argvs(self._target(), self.run_dir)
        for rc, _, err in await asyncio.gather(*(_run(argv) for argv in argvs)):
            if rc != 0:
                self.log.warning("stopping %s job %s: %s", self.backend, self.job_id, err.strip())
