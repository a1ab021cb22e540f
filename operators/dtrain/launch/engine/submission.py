"""The submission record: a detached job's handle, written into its run directory at submit time.

Deferrable mode checks a trigger event against it, and durable mode (a retry re-attaching
after a worker crash) checks the task state store's value against it: either way, only a
job this run directory really submitted is followed. Shared by the operator's two modes,
:mod:`dtrain.launch.airflow.deferrable` and :mod:`dtrain.launch.airflow.resumable`; here, on the
launcher's side, because the launcher follows a re-attached job too (:mod:`.following`) and must
import neither.
"""

from __future__ import annotations

import os
import re

from dtrain.errors import DTrainError
from dtrain.launch.backends import JobHandle
from dtrain.rundir import RunDir, UnsafeRunDir

DEFAULT_POLL_INTERVAL = 10.0
# Backend job ids appear in file names: a conservative alphabet, whatever the backend.
_JOB_ID = re.compile(r"^[A-Za-z0-9_.+-]{1,128}$")


def submission_path(handle: JobHandle) -> str:
    if not _JOB_ID.match(handle.backend_job_id) or not _JOB_ID.match(handle.backend):
        raise DTrainError(f"unexpected job handle: backend={handle.backend!r} job id={handle.backend_job_id!r}")
    return os.path.join(handle.run_dir, f"{handle.backend}-{handle.backend_job_id}.submission.json")


def write_submission(handle: JobHandle) -> None:
    """The handle, in the run directory (exclusive no-follow temp file + rename): what an event must
    match. Its public form: the ranks can read the run directory, so a job's secret is there as a digest."""
    RunDir(handle.run_dir).write_json(os.path.basename(submission_path(handle)), value=handle.public())


def check_submitted(handle: JobHandle, what: str) -> JobHandle:
    """``handle`` if its run directory holds the matching submission record (read without following
    a link, bounded); else DTrainError naming ``what`` (the trigger event, the recorded job) and why."""
    try:
        record = RunDir(handle.run_dir).read_json(os.path.basename(submission_path(handle)))
    except UnsafeRunDir:
        record = None
    if record is None:
        raise DTrainError(f"{what} names {handle.backend} job {handle.backend_job_id} in {handle.run_dir}, "
                          "which has no submission record")
    if record != handle.public():  # the task state store's handle has the secret, an event's its digest
        raise DTrainError(f"{what}: {handle.backend} job {handle.backend_job_id} does not match its "
                          "submission record")
    return handle
