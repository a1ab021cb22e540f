"""What the Retraining page shows for one pipeline, from its runs' records: pure, no Airflow.

Per run: the partition it trained for, the gate's metric for the new model, what became of
it (published, gated out and why, not published after the gate, skipped for lack of data,
failed before the gate, still running) and the tasks whose Training tab shows its job. The published value is read
from the published model's own ``metrics.json`` (dtrain.pipeline.publish) when it is there.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

from dtrain.mlflow.links import registered

ACTIVE_RUN_STATES = ("queued", "running")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _outcome(run: Mapping[str, Any], decision: Mapping[str, Any], published: Any) -> str:
    if published:
        return "published"
    if decision:
        if not decision.get("publish"):
            return "gated out"
        return "awaiting publish" if run.get("state") in ACTIVE_RUN_STATES else "passed the gate, not published"
    # Its raw-input listing found nothing and skipped the rest (a run marked failed by hand has its
    # unfinished tasks skipped too: that one failed).
    if run.get("no_data") and run.get("state") != "failed":
        return "skipped: no data"
    return "running" if run.get("state") in ACTIVE_RUN_STATES else "failed before the gate"


def pipeline_view(dag_id: str, runs: Sequence[Mapping[str, Any]],
                  read_published: Callable[[str], Mapping[str, Any] | None],
                  mlflow_url: str | None = None) -> dict[str, Any]:
    """``runs``: dtrain.ui.store.pipeline_runs(); ``read_published(metrics_path, partition)``: the
    published record, if it is this pipeline's for the run's partition (None otherwise: the
    recorded path is an XCom anyone who may edit the run can change; see dtrain.ui.provenance).
    ``mlflow_url``: the tracking server's UI (dtrain.hooks.mlflow.server_ui_url), for links to what an MLflow
    registry registered."""
    rows, points, metric, goal = [], [], None, None
    for run in runs:
        decision = run.get("decision") if isinstance(run.get("decision"), Mapping) else {}
        published = run.get("published") if isinstance(run.get("published"), Mapping) else None
        metric = metric or decision.get("metric")
        goal = goal or decision.get("goal")
        value = _number(decision.get("value"))
        path = published.get("metrics_path") if published else None
        record = read_published(path, run.get("partition")) if path else None
        if record and decision.get("metric"):
            value = _number((record.get("evaluation") or {}).get(decision["metric"])) or value
        outcome = _outcome(run, decision, published)
        rows.append({
            "run_id": run["run_id"], "partition": run.get("partition"), "state": run.get("state"),
            "run_type": run.get("run_type"), "outcome": outcome, "value": value,
            "baseline": _number(decision.get("baseline")), "reasons": [str(r) for r in decision.get("reasons") or []],
            "model_path": published.get("model_path") if published else None,
            "approval": (record or {}).get("approval"),
            "training_tasks": run.get("training_tasks") or [],
            "registered": registered(mlflow_url, published),
        })
        if value is not None and run.get("partition") and outcome in ("published", "gated out"):
            points.append({"partition": run["partition"], "value": value, "published": outcome == "published",
                           "run_id": run["run_id"]})
    return {"dag_id": dag_id, "metric": metric, "goal": goal, "runs": rows, "points": points,
            "published": sum(1 for r in rows if r["outcome"] == "published"),
            "gated_out": sum(1 for r in rows if r["outcome"] == "gated out")}
