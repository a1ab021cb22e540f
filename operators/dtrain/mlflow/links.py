"""Links from the Retraining page and the Training tab to the MLflow tracking server: pure, no Airflow.

The server's address comes from the deployment (dtrain.hooks.mlflow.server_ui_url: the Airflow
connection named by ``DTRAIN_MLFLOW_CONN_ID``, default ``mlflow_default``, its extra ``ui_url``,
else the tracking URL), never from a recorded value; what the tasks recorded (XComs, which anyone
who may edit a task instance can rewrite) only fills in ids, each checked against its grammar
(dtrain.grammar), so a link can only ever lead to a run or a model version on that server.
"""

from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import quote

from dtrain.grammar import MLFLOW_ALIAS, MLFLOW_NAME, MLFLOW_RUN_ID, MLFLOW_VERSION


def _ok(pattern, value: Any) -> bool:
    return isinstance(value, str) and pattern.fullmatch(value) is not None


def _experiment(value: Any) -> bool:
    return isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20


def run_link(base: str | None, record: Any) -> dict[str, str] | None:
    """``{"run_id", "url"}`` for a recorded ``{"run_id", "experiment_id"}``, or None."""
    if not isinstance(record, Mapping):
        return None
    run_id, experiment = record.get("run_id"), record.get("experiment_id")
    if not _ok(MLFLOW_RUN_ID, run_id) or not _experiment(experiment):
        return None
    return {"run_id": run_id, "url": f"{base}/#/experiments/{experiment}/runs/{run_id}" if base else ""}


def registered(base: str | None, published: Any) -> dict[str, Any] | None:
    """The version a publish registered, its alias then, and links to it and its run; None if the
    publish result is not an MLflow registry's (or does not pass the grammar)."""
    if not isinstance(published, Mapping) or published.get("registry") != "mlflow":
        return None
    name, version, alias = published.get("model_name"), published.get("version"), published.get("alias")
    if not (_ok(MLFLOW_NAME, name) and _ok(MLFLOW_VERSION, version) and _ok(MLFLOW_ALIAS, alias)):
        return None
    run = run_link(base, {"run_id": published.get("mlflow_run_id"), "experiment_id": published.get("experiment_id")})
    return {"model_name": name, "version": version, "alias": alias,
            "version_url": f"{base}/#/models/{quote(name, safe='')}/versions/{version}" if base else "",
            "run": run}
