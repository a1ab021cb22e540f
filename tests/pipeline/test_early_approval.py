"""An approval answered the moment the task awaits input, as an automated approver following the
README's REST recipe does, makes the run succeed (real `airflow standalone`, SQLite).

Airflow 3.3.1 and 3.3.2 fail such a run when the answer lands before the scheduler has processed
the parked worker's exit (dtrain.pipeline.approval). On an idle machine that exit often comes
first, so the test makes the worker slow, deterministically: a test plugin (slow_worker_plugin) keeps
the approve task's process alive a few seconds after it parked, as a loaded host does. The approver
itself waits for nothing but ``awaiting_input``."""

from __future__ import annotations

import os
import sys
from urllib.parse import quote

import pytest

from tests.airflow_services import REPO, AirflowServices
from tests.support import wait_for

DAG = "early_approval"
DAGS = os.path.join(REPO, "tests", "pipeline", "approval_dags")
PLUGINS = os.path.join(REPO, "tests", "pipeline", "slow_worker_plugin")


@pytest.fixture
def airflow(tmp_path):
    server = AirflowServices(str(tmp_path / "home"), dict(os.environ), DAGS)
    server.env["AIRFLOW__CORE__PLUGINS_FOLDER"] = PLUGINS
    server.env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + server.env.get("PATH", "")
    try:
        server.migrate()
        server.spawn("standalone", "standalone")
        server.wait_ready(DAG)
        yield server
    finally:
        server.stop()


def parked(airflow, run_id: str) -> bool:
    ti = airflow.task_instance(DAG, run_id, "approve")
    assert ti["state"] not in ("upstream_failed", "failed"), airflow.failure_report(DAG, run_id)
    return ti["state"] == "awaiting_input"


def test_an_answer_the_moment_the_task_awaits_input_publishes(airflow, capsys):
    run_id = "answered_at_once"
    airflow.trigger(DAG, run_id, {})
    ti_path = f"/dags/{DAG}/dagRuns/{quote(run_id)}/taskInstances/approve"
    wait_for(lambda: parked(airflow, run_id), timeout=300, interval=0.05, what="approve awaiting input")
    status, body = airflow.request("PATCH", f"{ti_path}/-1/hitlDetails",
                                   {"chosen_options": ["Approve"], "params_input": {}})
    assert status == 200, body
    run = airflow.wait_run(DAG, run_id, timeout=300)
    assert run["state"] == "success", airflow.failure_report(DAG, run_id)
    status, xcom = airflow.request("GET", f"/dags/{DAG}/dagRuns/{quote(run_id)}/taskInstances/publish/xcomEntries/"
                                          "return_value?deserialize=true&stringify=false")
    assert status == 200 and xcom["value"] == ["Approve"], xcom
    # Answered once: a retry that asked again would wait for a second answer that never comes.
    assert airflow.task_instance(DAG, run_id, "approve")["try_number"] <= 2
    raced = "finished with state success, but the task instance's state attribute is" in airflow.scheduler_log()
    with capsys.disabled():
        print(f"\n[approval] answered at once; the scheduler {'failed the parked try (the race), the retry completed' if raced else 'saw no race'}")
