"""The pipeline's approval step between two trivial tasks (tests/pipeline/test_early_approval.py):
what the factory builds for ``approval=True`` (dtrain.pipeline.approval.ApprovalStep), without the
training in front of it."""

from __future__ import annotations

import datetime as dt

from airflow.sdk import DAG, task

from dtrain.pipeline.approval import ApprovalStep

# The trivial tasks retry: on a loaded host the API server can time out a task's start
# (httpx.ReadTimeout in the supervisor), which fails a try before it ran; not what this DAG tests.
RETRY = {"retries": 3, "retry_delay": dt.timedelta(seconds=1)}

with DAG(dag_id="early_approval", schedule=None, start_date=dt.datetime(2026, 1, 1), catchup=False) as dag:

    @task(**RETRY)
    def gate() -> str:
        return "passed"

    @task(**RETRY)
    def publish(answer: dict) -> list:
        return answer["chosen_options"]

    approve = ApprovalStep(task_id="approve", subject="Publish?", body="the gate passed")
    gate() >> approve
    publish(approve.output)
