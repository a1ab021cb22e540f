"""Deferrable mode, operator side: submit the job, free the worker slot, resume on the event.

Generic over backends: any backend whose ``supports_detached`` is true (its jobs outlive the
submitting process) can be deferred. The operator calls three functions:

* :func:`defer_job` (from ``execute``): prepares the job, ``submit(detached=True)``, records
  the handle in the run directory, checks whether the job already ended (a short job, or a
  retry finding it done) and only then defers to
  :class:`~dtrain.launch.airflow.trigger.DistributedJobTrigger`.
* :func:`resume_job` (from ``execute_complete``): validates the trigger event against the
  submission record, cancels what may still run after a failure (the trigger only polls),
  and raises :class:`LaunchError` with the failing rank's (or the job's) last lines; on
  success returns the same XCom dict as a blocking run.
* :func:`kill_job` (from ``on_kill``): cancel the submitted job on every host.

Airflow itself is imported only by the trigger module; everything here runs in the task.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from dtrain.errors import DTrainError, LaunchError, SpecError
from dtrain.launch.backends import JobHandle, backend_for, detachable_backend_names, get_backend_class
from dtrain.launch.backends.base import STUCK_GRACE_S
from dtrain.launch.core.lost import FAULTS, LostNode
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.hang import HANG_EXIT_CODE
from dtrain.launch.engine.submission import DEFAULT_POLL_INTERVAL, check_submitted, write_submission
from dtrain.launch.node.lease import LOST_EXIT_CODE

SUBMISSION_KEY = "_dtrain_submission"  # attribute on the operator: the handle on_kill cancels
FOLLOWER_KEY = "_dtrain_follower"  # attribute on the operator: its task instance, once it follows a durable job
EVENT_STATUSES = ("success", "failed", "error", "hung")


def defer_job(operator, spec: LaunchSpec, context: Mapping | None = None, sink=None) -> dict[str, Any]:
    """Submit ``spec`` and defer ``operator`` until the job ends (raises Airflow's TaskDeferred).

    Returns the result directly, without deferring, when the job has already ended.
    """
    backend_cls = backend_for(spec)
    if not backend_cls.supports_detached:
        raise SpecError("deferrable", True, f"a backend whose jobs outlive the worker ({', '.join(detachable_backend_names())}); "
                                            f"backend={spec.placement.backend!r} with distribution={spec.distribution!r} "
                                            f"runs on {backend_cls.name!r}, which cannot")
    from dtrain.launch.engine.launcher import Launcher

    sink = sink or operator.log.info
    # The launcher prepares the job as a durable submission does (the ranks' env included).
    handle = Launcher(spec, sink=sink, backend=backend_cls(sink=sink)).submit_detached()
    write_submission(handle)
    setattr(operator, SUBMISSION_KEY, handle.to_dict())
    ti = (context or {}).get("ti")
    if ti is not None:
        ti.xcom_push(key=f"{handle.backend}_job_id", value=handle.backend_job_id)
    from dtrain.launch.airflow.trigger import DistributedJobTrigger

    trigger = DistributedJobTrigger(handle=handle.to_dict(),
                                    poll_interval=float(handle.data.get("poll_interval", DEFAULT_POLL_INTERVAL)),
                                    max_poll_interval=handle.data.get("max_poll_interval"),
                                    hang_timeout=spec.hang_timeout)
    event = trigger.poll_once()
    if event is not None:  # never defer for a job that is already over
        return resume_job(operator, event)
    operator.defer(trigger=trigger, method_name="execute_complete")
    raise AssertionError("unreachable: defer() raises TaskDeferred")  # pragma: no cover


def _validated(event: Any) -> tuple[dict[str, Any], JobHandle]:
    """The event, checked: the right shape, and a job this run directory really submitted."""
    if not isinstance(event, Mapping):
        raise DTrainError(f"unexpected trigger event (not a mapping): {event!r}")
    if event.get("status") not in EVENT_STATUSES:
        raise DTrainError(f"unexpected trigger event: status={event.get('status')!r}")
    handle = JobHandle.from_dict(event.get("handle"))
    get_backend_class(handle.backend)  # a registered backend
    check_submitted(handle, "trigger event")
    return {**dict(event), "tail": [str(line) for line in event.get("tail") or []]}, handle


def resume_job(operator, event: Any) -> dict[str, Any]:
    """Turn the trigger's event into the task's result, or raise with the job's last lines."""
    from dtrain.launch.engine.launcher import LaunchResult

    event, handle = _validated(event)
    if operator is not None:
        setattr(operator, SUBMISSION_KEY, handle.to_dict())  # on_kill during execute_complete still knows the job
    backend = get_backend_class(handle.backend)(sink=getattr(getattr(operator, "log", None), "info", print))
    lost = lost_of(event)
    if event["status"] != "success":  # the other nodes may still wait on the failed one; without a lost one's
        backend.cancel(handle, STUCK_GRACE_S if lost else None)  # ranks, none of them can reach a checkpoint
    result = LaunchResult.of_job(handle.job_id, handle.run_dir, handle.world_size,
                                 0 if event["status"] == "success" else (event.get("exit_code") or 1),
                                 time.time() - handle.submitted_at)
    where = f"{handle.backend} job {handle.backend_job_id}"
    if handle.backend_job_id != handle.job_id:
        where += f" ({handle.job_id})"
    if event["status"] == "error":
        raise LaunchError(f"lost track of {where}: {event.get('reason')}", 1, tail=event["tail"], state="LOST")
    if event["status"] == "hung":  # the trigger saw no progress, collected the stacks and cancelled the job
        stuck = [r for r in (event.get("hang") or {}).get("stuck_ranks") or [] if isinstance(r, int)]
        raise LaunchError(f"{where} {event.get('reason')}", HANG_EXIT_CODE, stuck[0] if stuck else None,
                          event["tail"], "HUNG")
    if event["status"] == "failed" and lost is not None:  # the nodes it left behind failed after it: not the cause
        raise LaunchError(f"{where} {lost.message()}", LOST_EXIT_CODE, None, event["tail"], "LOST")
    if event["status"] == "failed":
        summary = f"{where} ended {event.get('state')}"
        if not result.take_first_failure():  # no rank ran to its end (bad interpreter, node failure...): the job log says why
            error = LaunchError(f"{summary} with exit code {result.exit_code}; last lines of the job log:\n"
                                + "\n".join(event["tail"]), result.exit_code, state=_state(event))
            error.tail = event["tail"]
            raise error
        # Name the rank that failed first, with its own output.
        raise LaunchError(f"{summary}: rank {result.failed_rank} failed first with exit code {result.exit_code}",
                          result.exit_code, result.failed_rank, result.tail or event["tail"], _state(event))
    log = getattr(operator, "log", None)
    if log is not None:
        log.info("%s succeeded: world_size=%s in %.1fs, metrics=%s", where, result.world_size, result.duration_s,
                 result.metrics)
    return result.to_xcom() | {f"{handle.backend}_job_id": handle.backend_job_id}


def lost_of(event: Mapping[str, Any]) -> LostNode | None:
    """The lost node an event names (the trigger's status.lost), checked field by field; None when
    there is none or it is not one (then the failure is reported as any other)."""
    value = event.get("lost")
    if not isinstance(value, Mapping):
        return None
    node, address, fault, detail = (value.get(k) for k in ("node", "address", "fault", "detail"))
    if not (isinstance(node, int) and not isinstance(node, bool) and 0 <= node < (1 << 20) and fault in FAULTS
            and all(isinstance(text, str) and len(text) <= 1000 for text in (address, detail))):
        return None
    return LostNode(node=node, address=address, fault=fault, detail=detail)


def _state(event: Mapping[str, Any]) -> str | None:
    """The backend's final state from an event (what the retry policy reads), if it is a word."""
    state = event.get("state")
    return state if isinstance(state, str) and state.replace("_", "").isalnum() and len(state) <= 32 else None


def kill_job(operator) -> None:
    """on_kill: cancel the submitted job on every host, if this task submitted one."""
    record = getattr(operator, SUBMISSION_KEY, None)
    if not record:
        return
    handle = JobHandle.from_dict(record)
    get_backend_class(handle.backend)(sink=operator.log.info).cancel(handle)
