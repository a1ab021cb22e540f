"""What the Training tab shows, assembled from what the job wrote: pure, no Airflow.

Inputs are the training task's records (its XComs: the run record pushed before launch, the
result on success, the hang verdict) and its run directory (:class:`~dtrain.rundir.RunDir`).
Everything returned is JSON primitives: the JSON API serves it as is.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from dtrain.launch.engine.exits import first_failure_of
from dtrain.rundir import RunDir
from dtrain.stall_report import summarize_records
from dtrain.ui.metrics_cache import number

#: the per-rank curves, by API name: (title, y label)
CURVES = {
    "loss": ("Loss", "loss"),
    "samples_per_s": ("Throughput", "samples/s"),
    "data_wait_fraction": ("Data wait", "fraction of step time"),
}
#: points per rank and curve sent to a page (evenly thinned beyond, the last point always kept)
MAX_POINTS = 2000
#: points per rank in a plot: the SVG is about 540 px wide, more only cost drawing time on every refresh
MAX_PLOT_POINTS = 500
#: log lines per rank in the live tails
TAIL_LINES = 20


def _value(record: Mapping[str, Any], curve: str) -> float | None:
    """The record's point on ``curve``; None when it has none a browser and a plot can carry (a
    ratio of two rank-written numbers can overflow: 1e100 / 1e-100 is past what is plottable)."""
    if curve == "data_wait_fraction":
        step, wait = number(record.get("step_time_s")), number(record.get("data_wait_s"))
        return number(round(float(wait) / float(step), 6)) if step and step > 0 and wait is not None else None
    value = number(record.get(curve))
    return None if value is None else float(value)


def _thin(points: list[list[float]], limit: int) -> list[list[float]]:
    if len(points) <= limit:
        return points
    stride = len(points) / (limit - 1)
    return [points[int(i * stride)] for i in range(limit - 1)] + [points[-1]]


def curves(metrics: Mapping[int, list[dict[str, Any]]], since_step: int = -1,
           max_points: int = MAX_POINTS) -> dict[str, dict[str, list[list[float]]]]:
    """``{curve: {rank: [[step, value], ...]}}`` for every rank that logged a record after ``since_step``.

    A restart that resumed from a checkpoint logs some steps again: the newest record of a step wins,
    so a curve never runs backwards."""
    out: dict[str, dict[str, list[list[float]]]] = {name: {} for name in CURVES}
    for rank, records in sorted(metrics.items()):
        by_step: dict[int, dict[str, Any]] = {}
        for record in records:
            if record["step"] > since_step:
                by_step[record["step"]] = record
        for name in CURVES:
            points = [[step, v] for step, record in sorted(by_step.items())
                      if (v := _value(record, name)) is not None]
            if points:
                out[name][str(rank)] = _thin(points, max_points)
    return out


def plot_points(by_rank: Mapping[str, list[list[float]]]) -> dict[str, list[list[float]]]:
    """One curve's points per rank (from :func:`curves`), thinned for a plot."""
    return {rank: _thin(points, MAX_PLOT_POINTS) for rank, points in by_rank.items()}


def _job_state(ti_state: str | None, result: Mapping[str, Any] | None, failure, hang) -> str:
    if hang:
        return "hung"
    if ti_state in ("running", "deferred", "queued", "scheduled", "restarting", "up_for_reschedule"):
        return "running"
    if result and result.get("exit_code") == 0:
        return "succeeded"
    if failure is not None or ti_state in ("failed", "up_for_retry", "upstream_failed"):
        return "failed"
    return ti_state or "unknown"


def job_view(*, ti: Mapping[str, Any], record: Mapping[str, Any] | None, result: Mapping[str, Any] | None,
             hang: Mapping[str, Any] | None, run: RunDir | None,
             metrics: Mapping[int, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """The Training tab's summary of one training task instance.

    ``ti``: the task instance's dag_id, run_id, task_id, map_index, state, try_number,
    start_date, end_date, duration (as the API gives them). ``metrics``: the run's metrics records
    when already read (default: read here). ``record``: the run record
    (None: this task launched no job). ``result``: the task's return value (success only).
    ``hang``: the hang verdict XCom. ``run``: the recorded run directory."""
    view: dict[str, Any] = {"ti": dict(ti), "job": dict(record) if record else None}
    if run is None:
        view.update(state="no job", failure=None, hang=None, stall=None, checkpoints=[], stacks=[])
        return view
    metrics = run.metrics() if metrics is None else metrics
    failure = first_failure_of(run.exits())
    if failure is not None:
        failure = {k: failure.get(k) for k in ("rank", "node_rank", "local_rank", "exit_code", "time", "host", "tail")}
        failure["tail"] = [str(line) for line in (failure.get("tail") or [])][-40:]
    stacks = run.stack_ranks()
    hang_view = None
    if hang:
        hang_view = {k: hang.get(k) for k in ("stuck_ranks", "reason", "timeout_s", "silent_s", "missing_stacks",
                                              "detected_after_s", "message")}
    view.update(
        state=_job_state(ti.get("state"), result, failure, hang),
        result={k: result.get(k) for k in ("job_id", "exit_code", "duration_s", "world_size", "failed_rank",
                                           "metrics", "state")} if result else None,
        failure=failure, hang=hang_view, stacks=stacks,
        stall=summarize_records(metrics, os.path.join(run.path, "metrics")) if metrics else None,
        checkpoints=run.checkpoints(),
        ranks_reporting=sorted(metrics),
        steps=max((r[-1]["step"] for r in metrics.values() if r), default=None),
    )
    return view
