"""The Airflow plugin: Airflow's plugin manager loads it; macros render in a real task; links land in XCom."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
    assert "CheckpointLink" in text and "TensorBoardLink" in text


def test_macros_render_in_a_task(airflow_db):
    dag = load_test_dag("plugin_dags.py", "plugin_macros_test")
    run = dag.test(run_conf={"nodes": 3})
    ti = next(t for t in run.get_task_instances() if t.task_id == "render")
    assert ti.state == "success"
    assert ti.xcom_pull(task_ids="render") == {"lr": "0.8", "batch": "384"}


def test_extra_links_are_stored_for_the_ui(airflow_db, tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_TENSORBOARD_URL", "http://tb.example:6006/?regexInput={job_id}")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dag = load_test_dag("launch_operator_dags.py", "launch_operator_test")
    run = dag.test(run_conf={"nodes": 1, "out_dir": str(out_dir)})
    ti = next(t for t in run.get_task_instances() if t.task_id == "train")
    result = ti.xcom_pull(task_ids="train")
    assert ti.xcom_pull(task_ids="train", key="_link_CheckpointLink") == "file://" + result["checkpoint_dir"]
    assert ti.xcom_pull(task_ids="train", key="_link_MetricsLink") == "file://" + result["metrics_dir"]
    assert ti.xcom_pull(task_ids="train", key="_link_TensorBoardLink") == (
        "http://tb.example:6006/?regexInput=" + result["job_id"])
