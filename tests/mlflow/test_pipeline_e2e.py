"""The example pipeline (examples/tabular) end to end with MLflow as its registry and tracker: real
`airflow standalone`, moto's S3 and a real `mlflow server`. Four dates, in order: the first two are
approved and published (champion moves to each), the second after a failed first train try whose retry
resumes the same MLflow run; the third is gated out, the fourth rejected by a person (champion stays
both times); then a consumer loads models:/<name>@champion in a fresh process. Everything about the
outcome is asserted through MLflow's client API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlencode

import pytest

from tests.pipeline.conftest import TABULAR
from tests.pipeline.test_tabular_e2e import answer, decision, wait_for_approval

DAG = "tabular_mlflow"
MODEL = "tabular-rmse"
QUICK = {"epochs": 2, "lr": 0.02, "procs_per_node": 1}


def trigger(standalone, date: str, conf: dict) -> str:
    run_id = f"mlflow_{date}"
    status, body = standalone.request("POST", f"/dags/{DAG}/dagRuns",
                                      {"dag_run_id": run_id, "logical_date": f"{date}T00:00:00Z", "conf": conf})
    assert status in (200, 409), body
    return run_id


def finish(standalone, run_id: str, option: str | None) -> str:
    """Answer the run's approval with ``option`` (None: the gate stops it first); wait for its end."""
    if option is not None:
        wait_for_approval(standalone, run_id, dag_id=DAG)
        answer(standalone, run_id, option, dag_id=DAG)
    done = standalone.wait_run(DAG, run_id, timeout=900)
    assert done["state"] == "success", standalone.failure_report(DAG, run_id)
    return run_id


def run(standalone, date: str, conf: dict, option: str | None) -> str:
    return finish(standalone, trigger(standalone, date, conf), option)


def dtrain_api(standalone, path: str, params: dict | None = None) -> dict:
    """dtrain's own JSON API on the API server (the simple auth manager: everyone is admin here)."""
    url = f"http://127.0.0.1:{standalone.port}/dtrain{path}" + (f"?{urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=90) as response:
        return json.loads(response.read())


def runs_of(client, run_id: str) -> list:
    experiment = client.get_experiment_by_name(DAG)
    return client.search_runs([experiment.experiment_id], f"tags.`dtrain.run_id` = '{run_id}'")


def champion(client) -> str:
    return str(client.get_registered_model(MODEL).aliases["champion"])


def versions(client) -> list[str]:
    return sorted(v.version for v in client.search_model_versions(f"name='{MODEL}'"))


@pytest.mark.timeout(1800)  # four pipeline runs on 2 shared cores
def test_two_dates_publish_one_is_gated_out_one_rejected_a_retry_resumes_and_a_consumer_loads(
        mlflow_airflow, mlflow_server, client, tmp_path, capsys, own_tmpdir):
    started = time.monotonic()
    first = run(mlflow_airflow, "2026-04-01", QUICK, "Approve")
    assert versions(client) == ["1"] and champion(client) == "1"

    second = run(mlflow_airflow, "2026-04-02", {**QUICK, "epochs": 4, "fail_first_try": True}, "Approve")
    assert mlflow_airflow.task_instance(DAG, second, "train")["try_number"] == 2
    assert versions(client) == ["1", "2"] and champion(client) == "2"
    (tracked,) = runs_of(client, second)  # the retry resumed the run the first try created
    tags, data = tracked.data.tags, tracked.data
    assert tags["dtrain.task_try"] == "2" and tags["dtrain.partition"] == "2026-04-02"
    assert tags["dtrain.dag_id"] == DAG and tags["dtrain.dataset_version"] == "v1"
    assert tags["dtrain.run_dir"].endswith("/runs/tabular_mlflow/v1/2026-04-02/run-0")
    assert tracked.info.status == "FINISHED"
    with open(os.path.join(tags["dtrain.run_dir"], "mlflow-env-0.json"), encoding="utf-8") as fh:
        assert json.load(fh) == {"MLFLOW_RUN_ID": tracked.info.run_id, "MLFLOW_TRACKING_URI": mlflow_server.uri,
                                 "MLFLOW_EXPERIMENT_ID": tracked.info.experiment_id}  # what a logging script gets
    assert data.params["world_size"] == "1" and data.params["epochs"] == "4" and data.params["backend"] == "local"
    assert len(client.get_metric_history(tracked.info.run_id, "loss")) > 10
    assert "stall.CPUBottleneck" in data.metrics and 0 < data.metrics["eval.rmse"] < 2.0
    artifacts = {a.path for a in client.list_artifacts(tracked.info.run_id)}
    assert {"metrics.json", "trained", "model"} <= artifacts
    version = client.get_model_version(MODEL, "2")
    assert version.run_id == tracked.info.run_id and version.source == f"runs:/{tracked.info.run_id}/model"
    gate = decision(mlflow_airflow, DAG, second)
    assert gate["publish"] and gate["baseline_model"] == f"models:/{MODEL}/1"
    assert gate["baseline"] == pytest.approx(runs_of(client, first)[0].data.metrics["eval.rmse"])

    # Both compare with version 2 and neither may move champion: they run side by side.
    gated = trigger(mlflow_airflow, "2026-04-03", {**QUICK, "lr": 0.2})
    rejected = finish(mlflow_airflow, trigger(mlflow_airflow, "2026-04-04", {**QUICK, "epochs": 4}), "Reject")
    finish(mlflow_airflow, gated, None)
    gated_decision = decision(mlflow_airflow, DAG, gated)
    assert gated_decision["publish"] is False and gated_decision["baseline_model"] == f"models:/{MODEL}/2"
    assert mlflow_airflow.task_instance(DAG, gated, "publish")["state"] == "skipped"
    assert versions(client) == ["1", "2"] and champion(client) == "2"
    assert runs_of(client, gated)[0].data.metrics["eval.rmse"] == pytest.approx(gated_decision["value"])

    assert decision(mlflow_airflow, DAG, rejected)["publish"]  # it passed the gate; the person said no
    assert mlflow_airflow.task_instance(DAG, rejected, "publish")["state"] == "skipped"
    assert versions(client) == ["1", "2"] and champion(client) == "2"
    elapsed = time.monotonic() - started

    # The Retraining page: each run's registered version and its alias then, linked to the MLflow
    # UI at the connection's address; the Training tab links to the train task's run.
    view = next(p for p in dtrain_api(mlflow_airflow, "/api/retraining")["pipelines"] if p["dag_id"] == DAG)
    rows = {row["run_id"]: row for row in view["runs"]}
    assert [rows[r]["outcome"] for r in (first, second, gated, rejected)] == [
        "published", "published", "gated out", "passed the gate, not published"]
    registered = rows[second]["registered"]
    assert (registered["version"], registered["alias"], registered["model_name"]) == ("2", "champion", MODEL)
    assert registered["version_url"] == f"{mlflow_server.uri}/#/models/{MODEL}/versions/2"
    run_url = f"{mlflow_server.uri}/#/experiments/{tracked.info.experiment_id}/runs/{tracked.info.run_id}"
    assert registered["run"]["url"] == run_url and rows[first]["registered"]["version"] == "1"
    assert rows[gated]["registered"] is None and rows[rejected]["registered"] is None
    summary = dtrain_api(mlflow_airflow, "/api/ti/summary",
                         {"dag_id": DAG, "run_id": second, "task_id": "train", "map_index": -1})
    assert summary["mlflow_run"] == {"run_id": tracked.info.run_id, "url": run_url}

    # A consumer elsewhere: no dtrain, no example package on its path; the tracking server's URL only.
    consumer = ("import json, sys, torch, mlflow.pytorch\n"
                f"model = mlflow.pytorch.load_model('models:/{MODEL}@champion')\n"
                "with torch.no_grad():\n"
                "    print(json.dumps(model(torch.tensor(json.loads(sys.argv[1]))).squeeze(1).tolist()))\n")
    x = [[0.1 * i - 0.3 * j for i in range(8)] for j in range(3)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server.uri, "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", consumer, json.dumps(x)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch

    from tests.pipeline.conftest import example_module

    trained = client.download_artifacts(tracked.info.run_id, "trained/model.pt", str(tmp_path))
    with torch.no_grad():
        expected = example_module(TABULAR, "tabular_pipeline.evaluate").load_model(trained)(torch.tensor(x))
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == pytest.approx(expected.squeeze(1).tolist(), abs=1e-5)
    with capsys.disabled():
        print(f"\n[e2e] {DAG}: 4 dates against MLflow (1x1; one retry, one gated out, one rejected): {elapsed:.1f} s")
