"""Deferrable mode, operator side: submit the job, free the worker slot, resume on the event.

The operator calls three functions:

* :func:`defer_job` (from ``execute``): prepares and submits the job (``sbatch`` for
  ``slurm``; one detached agent per host for ``ssh``), records the submission in the run
  directory, checks whether the job already ended (a short job, or a retry finding it
  done) and only then defers to :class:`~operators.launch.trigger.DistributedJobTrigger`.
* :func:`resume_job` (from ``execute_complete``): validates the trigger event against the
  submission record, and raises :class:`LaunchError` with the failing rank's (or the
  job's) last lines on failure; on success returns the same XCom dict as a blocking run.
  For ``ssh`` a failure first stops the nodes still running (the trigger only polls).
* :func:`kill_job` (from ``on_kill``): ``scancel`` the job, or stop every host's node.

Airflow itself is imported only by the trigger module; everything here runs in the task.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Mapping

from operators.errors import DTrainError, LaunchError, SpecError
from operators.launch.backends import slurm
from operators.launch.job import Job, prepare_job
from operators.launch.spec import LaunchSpec

DEFERRABLE_BACKENDS = ("slurm", "ssh")
SUBMISSION_KEY = "_dtrain_submission"  # attribute on the operator: what on_kill cancels
_JOB_ID = {"slurm": re.compile(r"^\d+$"), "ssh": re.compile(r"^[A-Za-z0-9_.+-]{1,128}$")}


def submission_path(run_dir: str, job_id: str, backend: str = "slurm") -> str:
    return os.path.join(run_dir, f"{backend}-{job_id}.submission.json")


def _write_submission(job: Job, job_id: str, backend: str = "slurm", **extra: Any) -> dict[str, Any]:
    record = {"backend": backend, "slurm_job_id" if backend == "slurm" else "backend_job_id": job_id,
              "job_id": job.job_id, "run_dir": job.run_dir, "world_size": job.spec.world_size,
              "submitted_at": time.time(), **extra}
    path = submission_path(job.run_dir, job_id, backend)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    os.replace(tmp, path)
    return record


def _backend_job_id(record: Mapping[str, Any]) -> str:
    return str(record["slurm_job_id"] if record["backend"] == "slurm" else record["backend_job_id"])


def defer_job(operator, spec: LaunchSpec, options: Any = None, context: Mapping | None = None,
              sink=None) -> dict[str, Any]:
    """Submit ``spec`` and defer ``operator`` until the job ends (raises Airflow's TaskDeferred).

    ``options`` are the Slurm options (ignored for ssh, whose hosts and settings are in the
    spec). Returns the result directly, without deferring, when the job has already ended.
    """
    if spec.backend not in DEFERRABLE_BACKENDS:
        raise SpecError("deferrable", True, f"supported with backend in {DEFERRABLE_BACKENDS}, not {spec.backend!r}")
    if spec.backend == "ssh" and spec.distribution == "mpi":
        raise SpecError("deferrable", True, "not with distribution='mpi' (mpirun must stay attached to its ranks)")
    opts = slurm.coerce_options(options) if spec.backend == "slurm" else None  # validated before submitting
    sink = sink or operator.log.info
    job = prepare_job(spec)
    trigger_kwargs: dict[str, Any]
    if spec.backend == "slurm":
        backend_job_id = slurm.SlurmBackend(sink=sink, options=opts).submit(job)
        record = _write_submission(job, backend_job_id)
        poll_interval = opts.poll_interval
        trigger_kwargs = {}
    else:
        from operators.launch import ssh_deferred

        target = ssh_deferred.target_of(job)
        backend_job_id = job.job_id
        # Recorded before starting, so on_kill can stop hosts that a half-failed start reached.
        record = _write_submission(job, backend_job_id, "ssh", hosts=list(target.hosts), ssh=target.ssh)
        setattr(operator, SUBMISSION_KEY, record)
        ssh_deferred.start_job(job, sink)
        poll_interval = 2.0
        trigger_kwargs = {"hosts": list(target.hosts), "ssh": target.ssh}
    setattr(operator, SUBMISSION_KEY, record)
    ti = (context or {}).get("ti")
    if ti is not None:
        ti.xcom_push(key=f"{spec.backend}_job_id", value=backend_job_id)
    from operators.launch.trigger import DistributedJobTrigger

    trigger = DistributedJobTrigger(job_id=backend_job_id, run_dir=job.run_dir, backend=spec.backend,
                                    poll_interval=poll_interval, **trigger_kwargs)
    event = trigger.poll_once()
    if event is not None:  # never defer for a job that is already over
        return resume_job(operator, event)
    operator.defer(trigger=trigger, method_name="execute_complete")
    raise AssertionError("unreachable: defer() raises TaskDeferred")  # pragma: no cover


def _validated(event: Any) -> dict[str, Any]:
    """The event, checked: the right shape, and a job this run directory really submitted."""
    if not isinstance(event, Mapping):
        raise DTrainError(f"unexpected trigger event (not a mapping): {event!r}")
    status, backend = event.get("status"), event.get("backend")
    job_id, run_dir = str(event.get("job_id", "")), event.get("run_dir")
    if status not in ("success", "failed", "error") or backend not in DEFERRABLE_BACKENDS:
        raise DTrainError(f"unexpected trigger event: status={status!r} backend={backend!r}")
    if not _JOB_ID[backend].match(job_id) or not isinstance(run_dir, str):
        raise DTrainError(f"unexpected trigger event: job_id={job_id!r} run_dir={run_dir!r}")
    try:
        with open(submission_path(run_dir, job_id, backend), encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError) as e:
        raise DTrainError(f"trigger event names {backend} job {job_id} in {run_dir}, which has no submission record") from e
    if record.get("backend") != backend or _backend_job_id(record) != job_id or record.get("run_dir") != run_dir:
        raise DTrainError(f"trigger event for {backend} job {job_id} does not match its submission record {record}")
    tail = event.get("tail") or []
    return {**dict(event), "job_id": job_id, "tail": [str(line) for line in tail], "record": record}


def _stop_ssh_nodes(record: Mapping[str, Any]) -> None:
    from operators.launch import ssh_deferred

    target = ssh_deferred.Target(hosts=tuple(record["hosts"]), ssh=dict(record["ssh"]))
    ssh_deferred.stop_job(target, record["run_dir"])


def resume_job(operator, event: Any) -> dict[str, Any]:
    """Turn the trigger's event into the task's result, or raise with the job's last lines."""
    from operators.launch.launcher import LaunchResult, first_failure, read_metrics

    event = _validated(event)
    record, run_dir, backend = event["record"], event["run_dir"], event["backend"]
    if operator is not None:
        setattr(operator, SUBMISSION_KEY, record)  # on_kill during execute_complete still knows the job
    if backend == "ssh" and event["status"] != "success":
        _stop_ssh_nodes(record)  # the other hosts' nodes may still wait on the failed one
    metrics_dir = os.path.join(run_dir, "metrics")
    result = LaunchResult(
        job_id=record["job_id"], run_dir=run_dir, world_size=int(record["world_size"]),
        exit_code=0 if event["status"] == "success" else (event.get("exit_code") or 1),
        duration_s=round(time.time() - float(record["submitted_at"]), 3),
        checkpoint_dir=os.path.join(run_dir, "checkpoints"), metrics_dir=metrics_dir, metrics=read_metrics(metrics_dir),
    )
    where = f"{backend} job {event['job_id']}" + (f" ({record['job_id']})" if backend == "slurm" else "")
    if event["status"] == "error":
        raise LaunchError(f"lost track of {where}: {event.get('reason')}", 1, tail=event["tail"])
    if event["status"] == "failed":
        failure = first_failure(os.path.join(run_dir, "exits"))
        summary = f"{where} ended {event.get('state')}"
        if failure is None:  # no rank ran to its end (bad interpreter, node failure...): the job log says why
            error = LaunchError(f"{summary} with exit code {result.exit_code}; last lines of the job log:\n"
                                + "\n".join(event["tail"]), result.exit_code)
            error.tail = event["tail"]
            raise error
        # Name the rank that failed first, with its own output.
        raise LaunchError(f"{summary}: rank {failure['rank']} failed first with exit code {failure['exit_code']}",
                          failure["exit_code"], failure["rank"], failure["tail"] or event["tail"])
    log = getattr(operator, "log", None)
    if log is not None:
        log.info("%s succeeded: world_size=%s in %.1fs, metrics=%s", where, result.world_size, result.duration_s,
                 result.metrics)
    return result.to_xcom() | {f"{backend}_job_id": event["job_id"]}


def kill_job(operator) -> None:
    """on_kill: cancel the submitted job (or stop every host's node), if this task submitted one."""
    record = getattr(operator, SUBMISSION_KEY, None)
    if not record:
        return
    if record["backend"] == "ssh":
        _stop_ssh_nodes(record)
        return
    slurm.cancel(record["slurm_job_id"])
    slurm.wait_until_done(record["slurm_job_id"], record["run_dir"], timeout=30)
