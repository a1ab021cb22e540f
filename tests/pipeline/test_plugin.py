"""The Airflow plugin: Airflow's plugin manager loads it; macros render in a real task; links land in XCom."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from urllib.parse import quote

from tests.conftest import load_test_dag

BIN = os.path.dirname(sys.executable)


def test_airflow_plugin_manager_loads_the_plugin(airflow_db):
    out = subprocess.run([os.path.join(BIN, "airflow"), "plugins", "--output", "json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    plugins = {p["name"]: p for p in json.loads(out.stdout)}
    plugin = plugins["dtrain"]
    text = json.dumps(plugin)
    assert "scaled_lr" in text and "global_batch_size" in text
    assert "CheckpointLink" in text and "TensorBoardLink" in text and "TrainingLink" in text
    # the UI: a Training tab on every task instance and a Retraining page, served under /dtrain
    views = {v["name"]: v for v in plugin["external_views"]}
    assert views["Training"]["destination"] == "task_instance" and views["Training"]["url_route"] == "training"
    assert views["Training"]["href"] == "/dtrain/ti?dag_id={DAG_ID}&run_id={RUN_ID}&task_id={TASK_ID}&map_index={MAP_INDEX}"
    assert views["Retraining"]["destination"] == "nav" and views["Retraining"]["href"] == "/dtrain/retraining"
    assert [(a["name"], a["url_prefix"]) for a in plugin["fastapi_apps"]] == [("dtrain", "/dtrain")]


def test_macros_render_in_a_task(airflow_db):
    dag = load_test_dag("plugin_dags.py", "plugin_macros_test")
    run = dag.test(run_conf={"nodes": 3})
    ti = next(t for t in run.get_task_instances() if t.task_id == "render")
    assert ti.state == "success"
    assert ti.xcom_pull(task_ids="render") == {"lr": "0.8", "batch": "384"}


def test_extra_links_are_stored_for_the_ui(airflow_db, tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_TENSORBOARD_URL", "http://tb.example:6006/?regexInput={job_id}")
    monkeypatch.setenv("DTRAIN_STORAGE_URL", "https://files.example{path}")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dag = load_test_dag("launch_operator_dags.py", "launch_operator_test")
    run = dag.test(run_conf={"nodes": 1, "out_dir": str(out_dir)})
    ti = next(t for t in run.get_task_instances() if t.task_id == "train")
    result = ti.xcom_pull(task_ids="train")
    assert ti.xcom_pull(task_ids="train", key="_link_CheckpointLink") == "https://files.example" + result["checkpoint_dir"]
    # The Training tab of this very task instance, in the Airflow UI (no file:// link a browser cannot open)
    assert ti.xcom_pull(task_ids="train", key="_link_TrainingLink") == (
        f"/dags/launch_operator_test/runs/{quote(run.run_id, safe='')}/tasks/train/plugin/training")
    assert ti.xcom_pull(task_ids="train", key="_link_TensorBoardLink") == (
        "http://tb.example:6006/?regexInput=" + result["job_id"])
