"""Experiment tracking with MLflow, from what a training job wrote: no MLflow code in training scripts.

The pipeline's train task (dtrain.mlflow.operator) creates one MLflow run per train task
of a DAG run, or on a retry finds and resumes the same one; evaluate and publish find it the same
way. The run is found by a key derived from the DAG id, the DAG run id and its clear number
(:func:`run_key`), stored as the run's ``dtrain.key`` tag: never from an XCom (anyone who may edit a
task instance can rewrite those) and never from a file the ranks wrote.

Everything here runs on the Airflow worker, over MLflow's REST client (``mlflow-skinny``, the
``mlflow`` extra), imported on first use: never on the DAG-parse path.

What a run holds (docs/mlflow.md):

* tags ``dtrain.dag_id``, ``dtrain.run_id``, ``dtrain.task_try``, ``dtrain.partition``,
  ``dtrain.dataset_version``, ``dtrain.run_dir``, ``dtrain.checkpoint_dir``;
* params: the job's shape (nodes, procs_per_node, world_size, distribution, backend), the global
  batch and scaled learning rate when the script's result records them, and the pipeline's params;
* per-step metrics from the ranks' metrics records: rank 0's ``loss``, ``samples_per_s`` and
  ``data_wait_fraction``; the data-stall verdicts as ``stall.*`` (1 = the rule fired);
* evaluate's metrics (``eval.<name>``), and the artifacts ``metrics.json`` and the model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from typing import Any, Mapping

from dtrain.errors import DTrainError, SpecError
from dtrain.grammar import MLFLOW_NAME, MLFLOW_RUN_ID, check
from dtrain.hooks.mlflow import TrackingServer

#: XCom key of the train task's MLflow run ({"run_id", "experiment_id"}): for people and the UI,
#: which checks it against its grammar; the pipeline's later tasks find the run by its key instead
RUN_XCOM_KEY = "mlflow_run"
#: the run tag that identifies a train task's run (see :func:`run_key`)
KEY_TAG = "dtrain.key"
#: what the ranks get, so a script that does log to MLflow itself writes into the same run
RUN_ENV = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")
#: MLflow's limits: metrics per log_batch call, characters of a param value
BATCH = 1000
MAX_PARAM_CHARS = 6000
#: rank 0's per-step curves (dtrain.curves.CURVES) logged as metrics of the same name
STEP_CURVES = ("loss", "samples_per_s", "data_wait_fraction")


class TrackingError(DTrainError):
    """The tracking server is misconfigured, or the run a task needs is not there."""


def run_key(dag_id: str, run_id: str, clear_number: int) -> str:
    """The train task's run key: the same for every try of one DAG run, new when the run is cleared
    (a cleared run trains afresh in a new run directory, so it gets a new MLflow run too). A hash:
    any run id, whatever it contains, becomes hex that MLflow's filter grammar quotes safely."""
    text = json.dumps(["train", dag_id, run_id, int(clear_number or 0)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def experiment_id(client, name: str) -> str:
    """The experiment's id, created on first use."""
    check("experiment", name, MLFLOW_NAME, "an experiment name: letters, digits, _ . + - and spaces")
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found is not None else client.create_experiment(name)


def find_run(client, experiment: str, key: str):
    """The run with this key in ``experiment`` (newest first), or None."""
    check("run key", key, MLFLOW_RUN_ID, "32 hex digits (dtrain.mlflow.tracking.run_key)")
    runs = client.search_runs([experiment], f"tags.`{KEY_TAG}` = '{key}'", max_results=1,
                              order_by=["attributes.start_time DESC"])
    return runs[0] if runs else None


def require_run(client, experiment_name: str, key: str):
    """The train task's run, for the tasks after it: TrackingError when the train task made none."""
    found = client.get_experiment_by_name(experiment_name)
    run = find_run(client, found.experiment_id, key) if found is not None else None
    if run is None:
        raise TrackingError(f"no MLflow run tagged {KEY_TAG}={key} in experiment {experiment_name!r}: "
                            "the train task records one before it launches")
    return run


def start_or_resume(client, experiment_name: str, key: str, tags: Mapping[str, str]):
    """``(run, resumed)``: the key's run set RUNNING again with ``tags`` updated, or a new run."""
    experiment = experiment_id(client, experiment_name)
    run = find_run(client, experiment, key)
    if run is None:
        return client.create_run(experiment, tags={**tags, KEY_TAG: key}), False
    client.update_run(run.info.run_id, status="RUNNING")
    for name, value in tags.items():
        client.set_tag(run.info.run_id, name, value)
    return run, True


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:MAX_PARAM_CHARS]


def log_params(client, run, params: Mapping[str, Any]) -> dict[str, str]:
    """Log the params the run does not have yet (MLflow params are immutable: a retry logs the same
    ones again, which would be refused if a value differed); the ones logged."""
    have = dict(run.data.params) if getattr(run, "data", None) is not None else {}
    fresh = {name: _param_text(v) for name, v in params.items() if v is not None and name not in have}
    if fresh:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in fresh.items()]
        for start in range(0, len(items), 100):  # log_batch's limit on params
            client.log_batch(run.info.run_id, params=items[start:start + 100])
    return fresh


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def log_metrics(client, run_id: str, series: Mapping[str, list[tuple[int, float]]], timestamp_ms: int) -> int:
    """Log ``{name: [(step, value), ...]}`` in batches; the number of points logged."""
    from mlflow.entities import Metric

    points = [Metric(name, value, timestamp_ms, step) for name, pairs in series.items() for step, value in pairs]
    for start in range(0, len(points), BATCH):
        client.log_batch(run_id, metrics=points[start:start + BATCH])
    return len(points)


def step_series(metrics: Mapping[int, list[dict[str, Any]]]) -> dict[str, list[tuple[int, float]]]:
    """Rank 0's per-step curves from the ranks' metrics records (a resumed step: newest record wins)."""
    from dtrain.curves import curves

    every = curves(metrics, max_points=1 << 62)
    return {name: [(int(step), float(v)) for step, v in every[name].get("0", [])] for name in STEP_CURVES}


def stall_series(stall: Mapping[str, Any] | None, step: int) -> dict[str, list[tuple[int, float]]]:
    """The data-stall verdicts (dtrain.stall_report) as metrics at the job's last step."""
    rules = (stall or {}).get("rules") or {}
    out: dict[str, list[tuple[int, float]]] = {}
    for name, rule in rules.items():
        if isinstance(rule, Mapping):
            out[f"stall.{name}"] = [(step, 1.0 if rule.get("triggered") else 0.0)]
    cpu, balance = rules.get("CPUBottleneck") or {}, rules.get("LoadBalancing") or {}
    for name, value in (("stall.max_data_wait_fraction", cpu.get("max_data_wait_fraction")),
                        ("stall.slowest_to_median", balance.get("slowest_to_median"))):
        if _finite(value) is not None:
            out[name] = [(step, float(value))]
    return out


def scalar_series(prefix: str, values: Mapping[str, Any], step: int = 0) -> dict[str, list[tuple[int, float]]]:
    """The finite numbers of ``values`` as one point each, named ``<prefix><name>``."""
    return {f"{prefix}{name}": [(step, number)] for name, value in values.items()
            if (number := _finite(value)) is not None}


def write_json_artifact(client, run_id: str, name: str, value: Any) -> None:
    """``value`` as the run's artifact ``name`` (a JSON file at the artifact root)."""
    with tempfile.TemporaryDirectory(prefix="dtrain-mlflow-") as tmp:
        path = os.path.join(tmp, name)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(value, fh, indent=2, sort_keys=True, default=str)
        client.log_artifact(run_id, path)


def run_env(server: TrackingServer, run) -> dict[str, str]:
    """What a rank needs to log into the same run itself (no credentials: ranks run untrusted code;
    a script that logs brings its own)."""
    return dict(zip(RUN_ENV, (run.info.run_id, server.uri, run.info.experiment_id)))


def ensure_named(value: Any, field_name: str) -> str:
    if not isinstance(value, str):
        raise SpecError(field_name, value, "text")
    return check(field_name, value, MLFLOW_NAME, "a name of letters, digits, _ . + - and spaces, "
                                                 "starting with a letter or digit (at most 256)")
