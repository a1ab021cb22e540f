"""The submission record: a detached job's handle, written into its run directory at submit time.

Deferrable mode checks a trigger event against it, and durable mode (a retry re-attaching
after a worker crash) checks the task state store's value against it: either way, only a
job this run directory really submitted is followed. Shared by :mod:`dtrain.launch.deferrable`
and :mod:`dtrain.launch.resumable`, which the launcher also uses (so it imports neither).
"""

from __future__ import annotations

import json
import os
import re

from dtrain.errors import DTrainError
from dtrain.launch.backends import JobHandle

DEFAULT_POLL_INTERVAL = 10.0
# Backend job ids appear in file names: a conservative alphabet, whatever the backend.
_JOB_ID = re.compile(r"^[A-Za-z0-9_.+-]{1,128}$")


def submission_path(handle: JobHandle) -> str:
    if not _JOB_ID.match(handle.backend_job_id) or not _JOB_ID.match(handle.backend):
        raise DTrainError(f"unexpected job handle: backend={handle.backend!r} job id={handle.backend_job_id!r}")
    return os.path.join(handle.run_dir, f"{handle.backend}-{handle.backend_job_id}.submission.json")


def write_submission(handle: JobHandle) -> None:
    """The handle, in the run directory (temp file + rename): what an event must match."""
    path = submission_path(handle)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(handle.to_dict(), fh)
    os.replace(tmp, path)
