"""Deferrable mode, operator side: submit the job, free the worker slot, resume on the event.

The operator calls three functions:

* :func:`defer_job` (from ``execute``): prepares and submits the job, records the
  submission in the run directory, checks whether it already ended (a short job, or a
  retry finding its job done) and only then defers to
  :class:`~operators.launch.trigger.DistributedJobTrigger`.
* :func:`resume_job` (from ``execute_complete``): validates the trigger event against the
  submission record, and raises :class:`LaunchError` with the failing rank's (or the
  job's) last lines on failure; on success returns the same XCom dict as a blocking run.
* :func:`kill_job` (from ``on_kill``): ``scancel`` the submitted job.

Airflow itself is imported only by the trigger module; everything here runs in the task.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping

from operators.errors import DTrainError, LaunchError, SpecError
from operators.launch.backends import slurm
from operators.launch.job import Job, prepare_job
from operators.launch.spec import LaunchSpec

DEFERRABLE_BACKENDS = ("slurm",)
SUBMISSION_KEY = "_dtrain_submission"  # attribute on the operator: what on_kill cancels


def submission_path(run_dir: str, slurm_job_id: str) -> str:
    return os.path.join(run_dir, f"slurm-{slurm_job_id}.submission.json")


def _write_submission(job: Job, slurm_job_id: str) -> dict[str, Any]:
    record = {"backend": "slurm", "slurm_job_id": slurm_job_id, "job_id": job.job_id, "run_dir": job.run_dir,
              "world_size": job.spec.world_size, "submitted_at": time.time()}
    path = submission_path(job.run_dir, slurm_job_id)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    os.replace(tmp, path)
    return record


def defer_job(operator, spec: LaunchSpec, options: Any = None, context: Mapping | None = None,
              sink=None) -> dict[str, Any]:
    """Submit ``spec`` and defer ``operator`` until the job ends (raises Airflow's TaskDeferred).

    Returns the result directly, without deferring, when the job has already ended.
    """
    if spec.backend not in DEFERRABLE_BACKENDS:
        raise SpecError("deferrable", True, f"supported with backend in {DEFERRABLE_BACKENDS}, not {spec.backend!r}")
    opts = slurm.coerce_options(options)  # validated before anything is submitted
    sink = sink or operator.log.info
    job = prepare_job(spec)
    backend = slurm.SlurmBackend(sink=sink, options=opts)
    slurm_job_id = backend.submit(job)
    record = _write_submission(job, slurm_job_id)
    setattr(operator, SUBMISSION_KEY, record)
    ti = (context or {}).get("ti")
    if ti is not None:
        ti.xcom_push(key="slurm_job_id", value=slurm_job_id)
    status = slurm.query(slurm_job_id, job.run_dir)
    if status.done:  # never defer for a job that is already over
        from operators.launch.trigger import event_payload

        return resume_job(operator, event_payload("slurm", job.run_dir, status))
    from operators.launch.trigger import DistributedJobTrigger

    operator.defer(
        trigger=DistributedJobTrigger(job_id=slurm_job_id, run_dir=job.run_dir, backend="slurm",
                                      poll_interval=opts.poll_interval),
        method_name="execute_complete",
    )
    raise AssertionError("unreachable: defer() raises TaskDeferred")  # pragma: no cover


def _validated(event: Any) -> dict[str, Any]:
    """The event, checked: the right shape, and a job this run directory really submitted."""
    if not isinstance(event, Mapping):
        raise DTrainError(f"unexpected trigger event (not a mapping): {event!r}")
    status, backend = event.get("status"), event.get("backend")
    job_id, run_dir = str(event.get("job_id", "")), event.get("run_dir")
    if status not in ("success", "failed", "error") or backend not in DEFERRABLE_BACKENDS:
        raise DTrainError(f"unexpected trigger event: status={status!r} backend={backend!r}")
    if not job_id.isdigit() or not isinstance(run_dir, str):
        raise DTrainError(f"unexpected trigger event: job_id={job_id!r} run_dir={run_dir!r}")
    try:
        with open(submission_path(run_dir, job_id), encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError) as e:
        raise DTrainError(f"trigger event names slurm job {job_id} in {run_dir}, which has no submission record") from e
    if record.get("slurm_job_id") != job_id or record.get("run_dir") != run_dir:
        raise DTrainError(f"trigger event for slurm job {job_id} does not match its submission record {record}")
    tail = event.get("tail") or []
    return {**dict(event), "job_id": job_id, "tail": [str(line) for line in tail], "record": record}


def resume_job(operator, event: Any) -> dict[str, Any]:
    """Turn the trigger's event into the task's result, or raise with the job's last lines."""
    from operators.launch.launcher import LaunchResult, first_failure, read_metrics

    event = _validated(event)
    record, run_dir = event["record"], event["run_dir"]
    if operator is not None:
        setattr(operator, SUBMISSION_KEY, record)  # on_kill during execute_complete still knows the job
    checkpoint_dir, metrics_dir = os.path.join(run_dir, "checkpoints"), os.path.join(run_dir, "metrics")
    result = LaunchResult(
        job_id=record["job_id"], run_dir=run_dir, world_size=int(record["world_size"]),
        exit_code=0 if event["status"] == "success" else (event.get("exit_code") or 1),
        duration_s=round(time.time() - float(record["submitted_at"]), 3),
        checkpoint_dir=checkpoint_dir, metrics_dir=metrics_dir, metrics=read_metrics(metrics_dir),
    )
    log = getattr(operator, "log", None)
    if event["status"] == "error":
        raise LaunchError(f"lost track of slurm job {event['job_id']}: {event.get('reason')}", 1,
                          tail=event["tail"])
    if event["status"] == "failed":
        failure = first_failure(os.path.join(run_dir, "exits"))
        summary = f"slurm job {event['job_id']} ({record['job_id']}) ended {event.get('state')}"
        if failure is None:  # no rank ran to its end (bad interpreter, node failure...): the job log says why
            error = LaunchError(f"{summary} with exit code {result.exit_code}; last lines of the job log "
                                f"{slurm.log_path(run_dir, event['job_id'])}:\n" + "\n".join(event["tail"]),
                                result.exit_code)
            error.tail = event["tail"]
            raise error
        # Name the rank that failed first, with its own output.
        raise LaunchError(f"{summary}: rank {failure['rank']} failed first with exit code {failure['exit_code']}",
                          failure["exit_code"], failure["rank"], failure["tail"] or event["tail"])
    if log is not None:
        log.info("slurm job %s succeeded: world_size=%s in %.1fs, metrics=%s", event["job_id"], result.world_size,
                 result.duration_s, result.metrics)
    return result.to_xcom() | {"slurm_job_id": event["job_id"]}


def kill_job(operator) -> None:
    """on_kill: cancel the submitted job, if this task submitted one and it may still run."""
    record = getattr(operator, SUBMISSION_KEY, None)
    if record:
        slurm.cancel(record["slurm_job_id"])
        slurm.wait_until_done(record["slurm_job_id"], record["run_dir"], timeout=30)
