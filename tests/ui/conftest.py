"""Fixtures for the Training tab's API tests: real training jobs run by dag.test() (one that fails on
a rank, one that hangs) and Airflow's real API server app, in this process, with its plugin mounted."""

from __future__ import annotations

import os

import pytest

from tests.conftest import load_test_dag

UI_DAGS = os.path.join("tests", "ui", "dags")


def run_ui_dag(**conf):
    dag = load_test_dag("ui_dags.py", "ui_training", folder=UI_DAGS)
    return dag.test(run_conf=conf)


@pytest.fixture(scope="session")
def failed_run(airflow_db):
    """1 node x 2 ranks; rank 1 waits long for data (CPUBottleneck) and exits 3 at step 8, after rank 0
    checkpointed step 5."""
    run = run_ui_dag(nodes=1, procs_per_node=2,
                     args=["--steps", "12", "--fail-rank", "1", "--fail-step", "8", "--slow-data-rank", "1"])
    assert run.state == "failed"
    return run


@pytest.fixture(scope="session")
def hung_run(airflow_db):
    """1 node x 2 ranks; rank 1 goes silent at step 4 while rank 0 waits in the all-reduce: the
    launcher's hang watch (hang_timeout 8 s) dumps both stacks and stops the job. Starting the ranks
    (importing torch, the gloo rendezvous: longer than 5 s on a loaded 2-core machine) is not judged
    against hang_timeout (dtrain.launch.engine.hang.STARTUP_S)."""
    run = run_ui_dag(nodes=1, procs_per_node=2, hang_timeout="8",
                     args=["--steps", "100", "--hang-rank", "1", "--hang-step", "4"])
    assert run.state == "failed"
    return run


@pytest.fixture(scope="session")
def api(airflow_db):
    """Airflow's API server app (core API + plugins, as `airflow api-server` builds it) with an auth
    manager that grants DAGs per user (tests/ui/auth.py), and a token maker: ``api.token(name, role)``."""
    from fastapi.testclient import TestClient

    from airflow.api_fastapi import app as api_app
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from airflow.configuration import conf

    options = (("core", "auth_manager"), ("core", "simple_auth_manager_users"), ("api_auth", "jwt_secret"))
    saved = {option: conf.get(*option, fallback=None) for option in options}
    conf.set("core", "auth_manager", "tests.ui.auth.DagScopedAuthManager")
    conf.set("core", "simple_auth_manager_users", "admin:admin,viewer:viewer,outsider:viewer,a_only:viewer")
    conf.set("api_auth", "jwt_secret", os.urandom(48).hex())  # 96 characters: as long as SHA512 wants
    api_app._AuthManagerState.instance = None
    try:
        client = TestClient(api_app.create_app("core"))
        manager = api_app.get_auth_manager()
        client.token = lambda name, role: manager.generate_jwt(SimpleAuthManagerUser(username=name, role=role))
        yield client
    finally:
        api_app._AuthManagerState.instance = None
        for (section, key), value in saved.items():
            if value is None:
                conf.remove_option(section, key)
            else:
                conf.set(section, key, value)


def runs_root() -> str:
    """Where the operator puts run directories by default: the first configured runs root."""
    return os.path.join(os.environ["DTRAIN_HOME"], "runs")


def mark(path: str, dag_id: str, run_id: str, task_id: str = "train", try_number: int = 1, **changes) -> None:
    """Mark ``path`` as the operator marks a run directory before it launches (``changes``: what a
    forged marker says differently)."""
    from types import SimpleNamespace

    from dtrain.rundir import marker_of
    from dtrain.rundir import MARKER, RunDir

    ti = SimpleNamespace(dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=-1, try_number=try_number)
    RunDir(path).write_json(MARKER, value={**marker_of(ti, path), **changes})


@pytest.fixture
def patch_run_record(api, failed_run):
    """``patch(run_dir)``: point the failed run's training record at ``run_dir`` with a real REST
    PATCH of its XCom (what anyone who may edit that DAG's task instances can do). The original record
    is put back at the end, pass or fail."""
    from dtrain.launch.core.job import RUN_RECORD_KEY
    from tests.ui.client import rest, xcom_entries

    path = xcom_entries("ui_training", failed_run.run_id, "train", RUN_RECORD_KEY)
    original = rest(api, "GET", path).json()["value"]
    assert isinstance(original, dict) and original["run_dir"].startswith(runs_root()), original

    def patch(run_dir: str) -> None:
        response = rest(api, "PATCH", path, {"value": {**original, "run_dir": run_dir}, "map_index": -1})
        assert response.status_code == 200, response.text

    try:
        yield patch
    finally:
        assert rest(api, "PATCH", path, {"value": original, "map_index": -1}).status_code == 200


@pytest.fixture
def own_run_dir(api, failed_run, patch_run_record):
    """A fresh run directory of the failed run's training task, marked as its operator marks one and
    recorded in its XCom: a test fills it with what ranks might write. Removed at the end."""
    import pathlib
    import shutil
    import uuid

    from tests.ui.client import rest

    ti = rest(api, "GET", f"/dags/ui_training/dagRuns/{failed_run.run_id}/taskInstances/train").json()
    top = os.path.join(runs_root(), "ui_training", f"test-{uuid.uuid4().hex[:8]}")
    path = os.path.join(top, "train")
    try:
        mark(path, "ui_training", failed_run.run_id, try_number=ti["try_number"])
        patch_run_record(path)
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def pipeline_run(api):
    """``make(run_id, logical_date, {(task_id, key): value})``: a run of the example retraining pipeline
    created through the REST API (never scheduled: no scheduler runs here) with those XComs, as its
    tasks (or anyone who may edit them) would record them. Deleted at the end, pass or fail."""
    from tests.ui.client import rest, xcom_entries

    made = []

    def make(run_id: str, logical_date: str, xcoms: dict) -> None:
        response = rest(api, "POST", "/dags/retrain_pipeline/dagRuns",
                        {"dag_run_id": run_id, "logical_date": logical_date})
        assert response.status_code == 200, response.text
        made.append(run_id)
        for (task_id, key), value in xcoms.items():
            response = rest(api, "POST", xcom_entries("retrain_pipeline", run_id, task_id),
                            {"key": key, "value": value})
            assert response.status_code == 201, response.text

    try:
        yield make
    finally:
        for run_id in made:
            rest(api, "DELETE", f"/dags/retrain_pipeline/dagRuns/{run_id}")
