"""The example pipeline (examples/tabular: a user's own package, CSV in, RMSE minimized) end to end
with real Airflow: `airflow dags test`, a REST trigger with params, a backfill over two dates whose
gate publishes only the better model, and a person approving one run and rejecting another
through the REST API (Airflow's own ApprovalOperator)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from urllib.parse import quote

from .conftest import BIN, TABULAR, bundle
from .test_retrain_e2e import backfill_create

DAG = "tabular_retraining"
REVIEWED = "tabular_retraining_reviewed"
DAG_FILE = os.path.join(TABULAR, "dags", "tabular_retraining.py")
QUICK = {"epochs": 2, "lr": 0.02, "procs_per_node": 1}


def published(env: dict[str, str], date: str, dag_id: str = DAG) -> str:
    return os.path.join(env["DTRAIN_SHARED_FS"], "models", dag_id, "v1", date)


def record(env: dict[str, str], date: str, dag_id: str = DAG) -> dict:
    with open(os.path.join(published(env, date, dag_id), "metrics.json"), encoding="utf-8") as fh:
        return json.load(fh)


def decision(deployment, dag_id: str, run_id: str) -> dict:
    """What the gate task pushed to XCom (key "decision"), read back through the REST API."""
    status, body = deployment.request(
        "GET", f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/gate/xcomEntries/decision"
               "?deserialize=true&stringify=false")
    assert status == 200, body
    value = body["value"]
    return json.loads(value) if isinstance(value, str) else value


def test_a_dags_test_publishes_the_first_model(airflow_db, pipeline_env, capsys):
    # The team's DAG folder is the default bundle for this command, as in their own deployment.
    env = {**pipeline_env, "AIRFLOW__CORE__DAGS_FOLDER": os.path.dirname(DAG_FILE),
           "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps([bundle("dags-folder", os.path.dirname(DAG_FILE))])}
    started = time.monotonic()
    proc = subprocess.run([os.path.join(BIN, "airflow"), "dags", "test", DAG, "2026-03-01", "-f", DAG_FILE,
                           "--conf", json.dumps({"epochs": 4.0})], env=env, capture_output=True, text=True,
                          timeout=900)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    first = record(pipeline_env, "2026-03-01")
    assert first["pipeline"] == DAG and first["partition"] == "2026-03-01" and first["world_size"] == 2
    assert first["training"]["epochs"] == 4 and first["training"]["warm_start_from"] is None
    assert 0 < first["evaluation"]["rmse"] < 1.0 and first["evaluation"]["samples"] == 1000
    assert first["gate"]["publish"] and first["gate"]["reasons"][1] == "no published model to compare with"
    assert first["gate"]["reasons"][0].endswith("<= threshold 2")
    assert first["heldout"] == "s3://tabular-demo/heldout/v1/heldout.csv"
    assert os.path.isfile(os.path.join(published(pipeline_env, "2026-03-01"), "model.pt"))
    assert "PUBLISHED model:" in proc.stdout and "demo-secret-key" not in proc.stdout + proc.stderr
    with capsys.disabled():
        print(f"\n[e2e] airflow dags test {DAG} (1x2, 4 epochs): {elapsed:.1f} s")


def test_b_rest_trigger_with_params(deployment, capsys):
    status, before = deployment.request("GET", f"/dags/{DAG}/dagRuns")
    for bad in ({"epochs": 0}, {"lr": float("nan")}, {"lr": "fast"}, {"procs_per_node": 0}):
        status, body = deployment.request("POST", f"/dags/{DAG}/dagRuns",
                                          {"logical_date": "2026-02-27T00:00:00Z", "conf": bad})
        assert 400 <= status < 500 and "Invalid input for param" in json.dumps(body), (bad, status, body)
    status, after = deployment.request("GET", f"/dags/{DAG}/dagRuns")
    assert after["total_entries"] == before["total_entries"]

    started = time.monotonic()
    body = {"dag_run_id": "tab_rest_2026-02-27", "logical_date": "2026-02-27T00:00:00Z", "conf": QUICK}
    status, run = deployment.request("POST", f"/dags/{DAG}/dagRuns", body)
    assert status in (200, 409), run
    done = deployment.wait_run(DAG, "tab_rest_2026-02-27")
    assert done["state"] == "success", deployment.failure_report(DAG, "tab_rest_2026-02-27")
    rest = record(deployment.env, "2026-02-27")
    assert rest["training"]["epochs"] == 2 and rest["world_size"] == 1  # the params reached the ranks
    assert rest["gate"]["publish"] and rest["run_id"] == "tab_rest_2026-02-27"
    with capsys.disabled():
        print(f"\n[e2e] REST-triggered {DAG} run (1x1, 2 epochs): {time.monotonic() - started:.1f} s")


def test_c_backfill_of_two_dates_publishes_only_the_better_model(deployment, capsys):
    started = time.monotonic()
    out = backfill_create(deployment, "--from-date", "2026-03-02", "--to-date", "2026-03-03", "--dag-run-conf",
                          json.dumps({"epochs": 4}), "--max-active-runs", "1", dag_id=DAG)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    runs = {d: f"backfill__{d}T00:00:00+00:00" for d in ("2026-03-02", "2026-03-03")}
    for run_id in runs.values():
        run = deployment.wait_run(DAG, run_id, timeout=900)
        assert run["state"] == "success", deployment.failure_report(DAG, run_id)
    elapsed = time.monotonic() - started
    env = deployment.env
    # 03-02: more clean data, warm-started from the model before it: better, published.
    better = record(env, "2026-03-02")
    baseline = better["gate"]["baseline_model"]
    assert better["gate"]["publish"] and baseline.startswith(os.path.dirname(published(env, "x")))
    assert better["training"]["warm_start_from"] == baseline  # the warm start and the gate's baseline agree
    assert better["evaluation"]["rmse"] <= better["gate"]["baseline"]
    # 03-03: noisy labels, a worse model: gated out, not published; the run itself succeeds.
    worse = decision(deployment, DAG, runs["2026-03-03"])
    assert worse["publish"] is False and worse["baseline"] == better["evaluation"]["rmse"]
    assert worse["baseline_model"] == os.path.join(published(env, "2026-03-02"), "model.pt")
    assert worse["value"] > worse["baseline"] and "less than min_improvement 0" in worse["summary"], worse
    assert not os.path.exists(published(env, "2026-03-03"))
    assert deployment.task_instance(DAG, runs["2026-03-03"], "publish")["state"] == "skipped"
    assert [n for n in os.listdir(os.path.dirname(published(env, "x"))) if n.startswith(".")] == []
    with capsys.disabled():
        print(f"\n[e2e] backfill of {DAG} over 2 dates (1x2, 4 epochs): {elapsed:.1f} s; "
              f"rmse 03-02 {better['evaluation']['rmse']:.4f} published, 03-03 {worse['value']:.4f} gated out")


def wait_for_approval(deployment, run_id: str, timeout: float = 400, dag_id: str = REVIEWED) -> dict:
    deadline = time.monotonic() + timeout  # inside pytest-timeout's 600 s, so a miss says what it missed
    path = f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/approve/-1/hitlDetails"
    while time.monotonic() < deadline:
        status, run = deployment.request("GET", f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")
        assert status == 200 and run["state"] != "failed", deployment.failure_report(dag_id, run_id)
        ti = deployment.task_instance(dag_id, run_id, "approve")
        if ti["state"] == "awaiting_input":
            wait_until_parked(deployment, run_id, deadline, dag_id)
            status, detail = deployment.request("GET", path)
            assert status == 200, detail
            return detail
        time.sleep(1)  # two cheap GETs: a person answers about a second after the form appears
    raise AssertionError(f"{run_id}: approve never waited for input")


def wait_until_parked(deployment, run_id: str, deadline: float, dag_id: str = REVIEWED) -> None:
    """Until the scheduler has seen the parked task's process exit. Airflow 3.3.1 races there: an
    answer that lands in between (here 0.25 s after parking; no person is that quick) re-queues
    the task, then the exit's "success" event finds it queued and fails it. The scheduler logs
    the event it processed, so the test answers after that line, as a person always would."""
    event = (f"Received executor event with state success for task instance TaskInstanceKey("
             f"dag_id='{dag_id}', task_id='approve', run_id='{run_id}'")
    while event not in deployment.scheduler_log():
        assert time.monotonic() < deadline, f"{run_id}: the scheduler never saw approve park"
        time.sleep(1)


def answer(deployment, run_id: str, option: str, dag_id: str = REVIEWED) -> None:
    path = f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/approve/-1/hitlDetails"
    status, body = deployment.request("PATCH", path, {"chosen_options": [option], "params_input": {}})
    assert status == 200, body


def test_d_a_person_approves_one_model_and_rejects_another(deployment, capsys):
    started = time.monotonic()
    rejected, approved = "review_2026-03-10", "review_2026-03-11"
    for run_id, date in ((rejected, "2026-03-10"), (approved, "2026-03-11")):
        status, run = deployment.request("POST", f"/dags/{REVIEWED}/dagRuns",
                                         {"dag_run_id": run_id, "logical_date": f"{date}T00:00:00Z", "conf": QUICK})
        assert status in (200, 409), run
    detail = wait_for_approval(deployment, rejected)
    assert detail["subject"] == f"Publish the {REVIEWED} model for 2026-03-10?"
    assert detail["body"].startswith("**gate: publish: rmse ") and "| rmse |" in detail["body"], detail["body"]
    answer(deployment, rejected, "Reject")
    run = deployment.wait_run(REVIEWED, rejected)
    assert run["state"] == "success"
    assert deployment.task_instance(REVIEWED, rejected, "publish")["state"] == "skipped"
    assert not os.path.exists(published(deployment.env, "2026-03-10", REVIEWED))  # rejected: not published

    wait_for_approval(deployment, approved)
    answer(deployment, approved, "Approve")
    run = deployment.wait_run(REVIEWED, approved)
    assert run["state"] == "success", deployment.failure_report(REVIEWED, approved)
    kept = record(deployment.env, "2026-03-11", REVIEWED)
    assert kept["approval"]["chosen_options"] == ["Approve"] and kept["gate"]["publish"]
    # The rejected model was never published, so the approved one had nothing to beat.
    assert kept["gate"]["baseline"] is None
    with capsys.disabled():
        print(f"\n[e2e] {REVIEWED}: one run rejected, one approved (1x1, 2 epochs each): "
              f"{time.monotonic() - started:.1f} s")
