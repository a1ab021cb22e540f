"""Re-attach after a worker crash: the operator's side of its durable (non-deferrable) mode.

A blocking task holds its job through its own process: when the worker dies (SIGKILL, a lost
machine) Airflow retries the task, and a retry that simply launched again would run a second
job next to the first one, which may still be training. In durable mode the operator instead

1. submits the job *detached* (``backend.submit(job, detached=True)``, as deferrable mode does:
   a Slurm job, or one ``detached_node`` daemon per SSH host, outlives the worker), writes the
   handle into the run directory (the submission record) and, through Airflow's
   ``ResumableJobMixin``, into the task state store;
2. follows the job from the worker by polling (:meth:`dtrain.launch.engine.launcher.Launcher.attach`,
   with :class:`~dtrain.launch.engine.following.Following`): same output streaming, failure records,
   teardown and result as a blocking run;
3. on a retry, reads the handle back and asks the backend where the job is
   (:func:`recorded_status`): still running -> follow it; ended well -> take its result;
   ended badly -> stop whatever of it may still run, then submit afresh (resuming from the
   checkpoint in the same run directory).

No Airflow import: the operator maps these onto the mixin's methods. The stored value is only
trusted when the run directory holds the same submission record (:func:`recorded_handle`): a
value edited through the REST API cannot make the task poll or cancel anything else.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Any, Callable

from dtrain.errors import DTrainError
from dtrain.launch.backends import Backend, JobHandle, JobStatus
from dtrain.launch.backends.base import SECRET_KEY
from dtrain.launch.engine.submission import check_submitted, taken_over, write_submission

# What get_job_status reports to the mixin: "<verdict>:<backend state>".
ACTIVE, SUCCEEDED, ENDED, NOT_OURS = "active", "succeeded", "ended", "not-ours"

__all__ = ["kept_for", "recorded_handle", "recorded_status", "status_word", "is_active", "is_succeeded",
           "with_secret", "write_submission"]

#: task instance states in which a try of the task follows, or will follow, its durable job
FOLLOWED_STATES = frozenset({"running", "deferred", "queued", "scheduled", "up_for_retry", "up_for_reschedule"})


def with_secret(handle: JobHandle) -> JobHandle:
    """``handle`` with a per-job secret (``data["secret"]``), if its backend gave it none (Slurm): the
    follower record is signed with it (:func:`dtrain.launch.engine.submission.write_follower`). Like the
    ssh backend's own, it is kept in the task state store and never in the run directory (only its digest)."""
    if SECRET_KEY in handle.data:
        return handle
    return dataclasses.replace(handle, data={**handle.data, SECRET_KEY: secrets.token_hex(32)})


def status_word(status: JobStatus) -> str:
    """The mixin's status string for ``status``. A job the backend could not be asked about counts
    as active: reconnecting (and giving up after repeated failed polls) never doubles a job,
    submitting again might."""
    if not status.done:
        return f"{ACTIVE}:{status.state}"
    return f"{SUCCEEDED if status.ok else ENDED}:{status.state}"


def is_active(word: str) -> bool:
    return word.startswith(f"{ACTIVE}:")


def is_succeeded(word: str) -> bool:
    return word.startswith(f"{SUCCEEDED}:")


def recorded_handle(value: Any, backend: str, run_dir: str) -> JobHandle:
    """The handle ``value`` (from the task state store) if it names a job this task submitted:
    the backend and run directory this try would use, and the submission record written there
    at submission. Raises DTrainError saying why not."""
    handle = JobHandle.from_dict(value)
    if handle.backend != backend or os.path.abspath(handle.run_dir) != os.path.abspath(run_dir):
        raise DTrainError(f"the recorded job ({handle.backend} in {handle.run_dir}) is not this task's "
                          f"({backend} in {run_dir})")
    check_submitted(handle, "the recorded job")
    return handle


def recorded_status(backend: Backend, value: Any, run_dir: str, warn: Callable[[str], Any]) -> str:
    """Where the recorded job is now, as :func:`status_word`; ``not-ours:`` when the value is not a
    job this task submitted (then it is neither polled nor cancelled, and a new job is submitted).
    A job that ended badly is cancelled first: with SSH, the other nodes of a job whose node
    failed may still run (the worker that would have stopped them is gone)."""
    try:
        handle = recorded_handle(value, backend.name, run_dir)
    except DTrainError as e:
        warn(f"[dtrain] not re-attaching: {e}")
        return f"{NOT_OURS}:"
    try:
        status = backend.poll(handle)
    except DTrainError as e:
        status = JobStatus(state="UNKNOWN", done=False, reason=str(e), reachable=False)
    word = status_word(status)
    if status.done and not status.ok:
        warn(f"[dtrain] {handle.backend} job {handle.backend_job_id} of an earlier try ended {status.state} "
             f"(exit {status.exit_code}); stopping what may remain of it before a new submission")
        backend.cancel(handle)
    return word


def kept_for(handle: JobHandle, try_number: int, state: Callable[[], str | None]) -> str:
    """Why try ``try_number``, being stopped (on_kill), must leave its durable job running; '' to cancel it.

    Airflow stops a try that way when a person stops the task (marked failed or success, cleared) and
    also when the scheduler has failed the try because its heartbeats stopped (its worker froze or was
    cut off, and came back), or when the worker itself is shutting down. The job is cancelled in the
    first case only: in the others a try of the task follows it, or will, by re-attaching. So the job is
    kept when a later try follows it (the follower record: no question to ask), or when the task
    instance's state, asked now (``state()``; None when Airflow cannot be asked), is one in which a try
    runs or will run (:data:`FOLLOWED_STATES`: the retry after this try was failed; this try's own
    worker stopping while the task instance still runs, whose retry re-attaches), or cannot be asked: a
    person's stop reaches the worker through the API server, so a stop while it cannot be reached is the
    worker's (its heartbeats failed)."""
    later = taken_over(handle, try_number)
    if later is not None:
        return f"try {later} follows it now"
    now = state()
    if now is None:
        return "Airflow's API server cannot be reached to ask: a retry re-attaches to it"
    if now in FOLLOWED_STATES:
        return f"the task instance is {now}: a try of it follows the job or re-attaches to it"
    return ""
