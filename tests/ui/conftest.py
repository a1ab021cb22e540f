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
    launcher's hang watch (hang_timeout 5 s) dumps both stacks and stops the job."""
    run = run_ui_dag(nodes=1, procs_per_node=2, hang_timeout="5",
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
    conf.set("core", "simple_auth_manager_users", "admin:admin,viewer:viewer,outsider:viewer")
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
