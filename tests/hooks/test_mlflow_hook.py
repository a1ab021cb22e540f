"""dtrain.hooks.mlflow: the tracking server from an Airflow connection (given as AIRFLOW_CONN_<ID>), on a
worker and on the API server; and the tracking code's place below the UI (no import of dtrain.ui)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtrain.hooks.mlflow import server_ui_url, tracking_server


def test_a_worker_reads_the_server_and_its_sign_in_from_the_connection(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_DTRAIN_HOOK_MLFLOW", json.dumps({
        "conn_type": "https", "host": "mlflow.internal", "port": 8443, "schema": "/tracking/", "login": "ci",
        "password": "mlflow-secret-42", "extra": {"ui_url": "https://mlflow.example.com/"}}))
    server = tracking_server("dtrain_hook_mlflow")
    assert (server.uri, server.ui_url) == ("https://mlflow.internal:8443/tracking", "https://mlflow.example.com")
    assert server.credentials == {"MLFLOW_TRACKING_USERNAME": "ci", "MLFLOW_TRACKING_PASSWORD": "mlflow-secret-42"}
    assert "mlflow-secret-42" not in repr(server)


def test_the_api_server_reads_the_connection_its_variable_names(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_DTRAIN_HOOK_UI", json.dumps({
        "conn_type": "http", "extra": {"tracking_uri": "http://127.0.0.1:5000", "token": "t"}}))
    monkeypatch.setenv("DTRAIN_MLFLOW_CONN_ID", "dtrain_hook_ui")
    assert server_ui_url() == "http://127.0.0.1:5000"
    monkeypatch.setenv("DTRAIN_MLFLOW_CONN_ID", "dtrain_hook_no_such_mlflow")
    assert server_ui_url() is None  # no connection: the pages show ids without links


def test_a_connection_without_a_tracking_url_is_refused(monkeypatch):
    from dtrain.errors import SpecError

    monkeypatch.setenv("AIRFLOW_CONN_DTRAIN_HOOK_BAD", json.dumps({
        "conn_type": "http", "extra": {"tracking_uri": "file:///tmp/mlruns"}}))
    with pytest.raises(SpecError, match="tracking_uri"):
        tracking_server("dtrain_hook_bad")


def test_run_metrics_are_computed_without_importing_the_ui():
    # The tracked train task logs rank 0's curves: the code it shares with the Training tab lives
    # below both (dtrain.curves), so the tracking module never loads the UI package.
    code = ("import json, sys; from dtrain.mlflow.tracking import step_series; "
            "series = step_series({0: [{'step': 1, 'loss': 0.5, 'samples_per_s': 10.0}], 1: [{'step': 1, 'loss': 9.0}]}); "
            "print(json.dumps([series, sorted(m for m in sys.modules if m == 'dtrain.ui' or m.startswith('dtrain.ui.'))]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    series, ui_modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert series == {"loss": [[1, 0.5]], "samples_per_s": [[1, 10.0]], "data_wait_fraction": []}
    assert ui_modules == []


def test_the_earlier_registry_path_still_gives_the_registry_with_a_warning():
    from dtrain.mlflow.registry import MlflowRegistry

    with pytest.warns(DeprecationWarning, match="from dtrain.mlflow.registry import MlflowRegistry"):
        from dtrain.pipeline.registry_mlflow import MlflowRegistry as old_path
    assert old_path is MlflowRegistry


def test_a_tracking_registry_names_its_train_operator():
    from dtrain.mlflow.operator import TrackedTrainingOperator
    from dtrain.mlflow.registry import MlflowRegistry

    registry = MlflowRegistry("m", conn_id=None, tracking_uri="http://127.0.0.1:5000")
    assert registry.tracks_runs and registry.train_operator_class() is TrackedTrainingOperator


def test_a_pipeline_with_an_mlflow_registry_trains_with_the_tracked_operator():
    import datetime as dt

    from dtrain.mlflow.operator import TrackedTrainingOperator
    from dtrain.mlflow.registry import MlflowRegistry
    from dtrain.pipeline import DataConfig, GateConfig, PublishConfig, TrainingConfig, retraining_pipeline

    dag = retraining_pipeline(
        "dtrain_hooks_mlflow_pipeline",
        data=DataConfig(raw="s3://b/raw", processed="s3://b/processed", shared_fs="/shared",
                        transform="pkg.prep:transform"),
        training=TrainingConfig(command=["python", "-m", "pkg.train", "--output", "{output}"]),
        gate=GateConfig(evaluate="pkg.eval:evaluate", metric="rmse", goal="minimize"),
        publish=PublishConfig(registry=MlflowRegistry("m", conn_id=None, tracking_uri="http://127.0.0.1:5000")),
        schedule=None, start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc))
    assert type(dag.get_task("train")) is TrackedTrainingOperator
