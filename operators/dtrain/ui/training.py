"""What the Training tab shows, assembled from what the job wrote: pure, no Airflow.

Inputs are the training task's records (its XComs: the run record pushed before launch, the
result on success, the hang verdict) and its run directory (:class:`~dtrain.rundir.RunDir`).
Everything returned is JSON primitives: the JSON API serves it as is.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from dtrain.curves import CURVES, curves, thin  # noqa: F401 (CURVES, curves: the tab's views use them as training.*)
from dtrain.launch.core.exits import first_failure_of
from dtrain.rundir import RunDir, Unread
from dtrain.stall_report import summarize_records
from dtrain.ui.metrics_cache import MAX_STEP

#: points per rank in a plot: the SVG is about 540 px wide, more only cost drawing time on every refresh
MAX_PLOT_POINTS = 500
#: log lines per rank in the live tails
TAIL_LINES = 20
#: an elastic job's rounds shown (the launcher keeps its last 1000: dtrain.launch.core.elastic); a
#: longer list is no launcher's and is dropped whole
MAX_ROUNDS = 1000
#: rounds marked on a plot, the latest ones (the table lists them all)
MAX_MARKED_ROUNDS = 20
#: bounds of one round, as wide as the agents' round lines can say (dtrain.launch.core.elastic.ROUND_LINE)
MAX_ROUND_NUMBER = 999_999_999
MAX_ROUND_NODES = 4096
MAX_NODE_INDEX = 99_999
MAX_WORLD_SIZE = 1_000_000
ROUND_KEYS = frozenset({"round", "nodes", "world_size", "resume_step"})
#: each rank's first steps (worker start-up, warm caches) that the stall verdicts and their table leave
#: out (dtrain.stall_report's ``skip_first``): the tab names them beside the steps logged
WARMUP_STEPS = 5


def plot_points(by_rank: Mapping[str, list[list[float]]]) -> dict[str, list[list[float]]]:
    """One curve's points per rank (from :func:`curves`), thinned for a plot."""
    return {rank: thin(points, MAX_PLOT_POINTS) for rank, points in by_rank.items()}


def _int(value: Any, low: int, high: int) -> int | None:
    """``value`` if it is an int (not a bool) in [low, high], else None."""
    return value if type(value) is int and low <= value <= high else None


def _round(entry: Any) -> dict[str, Any] | None:
    """One round as the launcher records it, or None: its four keys, each of its type and in bounds
    (other keys are ignored, never shown); its nodes distinct, the world size a whole number of
    ranks per node."""
    if not isinstance(entry, dict) or not ROUND_KEYS <= entry.keys():
        return None
    number_ = _int(entry["round"], 0, MAX_ROUND_NUMBER)
    world_size = _int(entry["world_size"], 1, MAX_WORLD_SIZE)
    resume_step = _int(entry["resume_step"], 0, MAX_STEP)
    nodes = entry["nodes"]
    if number_ is None or world_size is None or resume_step is None or not isinstance(nodes, list) \
            or not 1 <= len(nodes) <= MAX_ROUND_NODES:
        return None
    if any(_int(node, 0, MAX_NODE_INDEX) is None for node in nodes) or len(set(nodes)) != len(nodes):
        return None
    if world_size % len(nodes):
        return None
    return {"round": number_, "nodes": list(nodes), "world_size": world_size, "resume_step": resume_step}


def rounds_of(result: Any) -> list[dict[str, Any]]:
    """An elastic job's rounds from the training task's result XCom (``return_value["rounds"]``),
    validated (:func:`checked_rounds`); ``[]``: none (a fixed job, a job still running: it has no
    result yet, or one that failed: :func:`task_rounds`)."""
    return checked_rounds(result.get("rounds") if isinstance(result, dict) else None)


def checked_rounds(rounds: Any) -> list[dict[str, Any]]:
    """Rounds from an XCom, which is untrusted (anyone who may edit the task instance may PATCH it): a
    list longer than :data:`MAX_ROUNDS` is dropped whole, a malformed round (see :func:`_round`) or a
    round number seen before is dropped; the rest ordered by round number."""
    if not isinstance(rounds, list) or len(rounds) > MAX_ROUNDS:
        return []
    kept: dict[int, dict[str, Any]] = {}
    for entry in rounds:
        checked = _round(entry)
        if checked is not None and checked["round"] not in kept:
            kept[checked["round"]] = checked
    return [kept[n] for n in sorted(kept)]


def task_rounds(result: Any, rounds_xcom: Any) -> list[dict[str, Any]]:
    """An elastic job's rounds: from its result (it succeeded), else from the rounds XCom the operator
    pushes for a job that failed (``dtrain_rounds``); validated either way (:func:`rounds_of`)."""
    if isinstance(result, dict) and "rounds" in result:
        return rounds_of(result)
    return checked_rounds(rounds_xcom)


def round_marks(rounds: list[dict[str, Any]]) -> tuple[tuple[int, int, int], ...]:
    """What a plot marks of the (validated) rounds: (round, world size, resume step) of the latest
    :data:`MAX_MARKED_ROUNDS`; hashable, so it keys the plot's cache."""
    return tuple((r["round"], r["world_size"], r["resume_step"]) for r in rounds[-MAX_MARKED_ROUNDS:])


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
             metrics: Mapping[int, list[dict[str, Any]]] | None = None, rounds: Any = None) -> dict[str, Any]:
    """The Training tab's summary of one training task instance.

    ``ti``: the task instance's dag_id, run_id, task_id, map_index, state, try_number,
    start_date, end_date, duration (as the API gives them). ``metrics``: the run's metrics records
    when already read (default: read here). ``record``: the run record
    (None: this task launched no job). ``result``: the task's return value (success only).
    ``hang``: the hang verdict XCom. ``run``: the recorded run directory. ``rounds``: the rounds XCom of
    a failed elastic job; the view's rounds come from the result, else from it (:func:`task_rounds`;
    ``[]`` while the job runs)."""
    view: dict[str, Any] = {"ti": dict(ti), "job": dict(record) if record else None}
    if run is None:
        view.update(state="no job", failure=None, hang=None, stall=None, checkpoints=[], stacks=[], rounds=[],
                    unread=[])
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
        failure=failure, hang=hang_view, stacks=stacks, rounds=task_rounds(result, rounds),
        stall=_stall(metrics, run),
        checkpoints=run.checkpoints(),
        ranks_reporting=sorted(metrics),
        steps=max((r[-1]["step"] for r in metrics.values() if r), default=None),
    )
    view["unread"] = unread_view(run.unread)  # last: every listing above is in it
    return view


def _stall(metrics: Mapping[int, Any], run: RunDir) -> dict[str, Any] | None:
    if not metrics:
        return None
    stall = summarize_records(metrics, os.path.join(run.path, "metrics"), skip_first=WARMUP_STEPS)
    stall["warmup_steps"] = WARMUP_STEPS
    return stall


def unread_view(unread: Mapping[str, Unread]) -> list[dict[str, Any]]:
    """The folders of the run directory a listing stopped short of (a rank may fill one with files), and
    what the tab says of each: how many entries were read and how many more were not."""
    return [{"folder": folder, "read": u.read, "more": u.more, "counted_all": u.counted_all,
             "message": f"{folder}/ holds more entries than the tab reads: {u.read} read, "
                        f"{'' if u.counted_all else 'at least '}{u.more} more not read"}
            for folder, u in sorted(unread.items())]
