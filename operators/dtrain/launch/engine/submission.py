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
from dtrain.launch.backends.base import SECRET_KEY
from dtrain.launch.node.job_secret import mac, mac_matches
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


# -- the follower record: which try of the task follows a durable job now ----------------------------
#
# A try whose worker froze or was cut off is failed by the scheduler, and its retry re-attaches to the
# job on another worker. The stale try may still be alive: thawed, or reconnected, its worker hears that
# it should not run any more and stops it (SIGTERM, so on_kill, and its watch's teardown), and that
# stop must not cancel the job the retry follows. Each try records itself here as it submits or
# re-attaches; a stop checks it (:func:`taken_over`). The ranks can write the run directory, so the
# record is signed with the job's secret: a rank cannot keep its own job from being stopped.


def follower_path(handle: JobHandle) -> str:
    return submission_path(handle)[:-len(".submission.json")] + ".follower.json"


def _follower_key(handle: JobHandle) -> bytes:
    return str(handle.data.get(SECRET_KEY, "")).encode()


def _follower_message(handle: JobHandle, follower: int) -> bytes:
    return f"{handle.backend}:{handle.backend_job_id}:{follower}".encode()


def write_follower(handle: JobHandle, follower: int) -> None:
    """Try ``follower`` of the task follows the job from now on."""
    RunDir(handle.run_dir).write_json(os.path.basename(follower_path(handle)),
                                      value={"follower": follower,
                                             "mac": mac(_follower_key(handle), _follower_message(handle, follower))})


def follower_now(handle: JobHandle) -> int | None:
    """The try the follower record names, if the record is there, well-formed and signed for this job."""
    try:
        record = RunDir(handle.run_dir).read_json(os.path.basename(follower_path(handle)))
    except UnsafeRunDir:
        return None
    if not isinstance(record, dict):
        return None
    follower, given = record.get("follower"), record.get("mac")
    if type(follower) is not int or follower < 1 or not isinstance(given, str):
        return None
    return follower if mac_matches(_follower_key(handle), _follower_message(handle, follower), given) else None


def taken_over(handle: JobHandle, follower: int | None) -> int | None:
    """The later try that follows the job now, if one does; None while it is still ``follower``'s (or
    ``follower`` is None: a job no try of a task follows, e.g. the CLI's)."""
    if follower is None:
        return None
    now = follower_now(handle)
    return now if now is not None and now > follower else None
