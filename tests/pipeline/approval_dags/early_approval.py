"""The pipeline's approval step between two trivial tasks (tests/pipeline/test_early_approval.py):
what the factory builds for ``approval=True`` (dtrain.pipeline.approval.ApprovalStep), without the
training in front of it."""

from __future__ import annotations

import datetime as dt

from airflow.sdk import DAG, task

from dtrain.pipeline.approval import ApprovalStep

with DAG(dag_id="early_approval", schedule=None, start_date=dt.datetime(2026, 1, 1), catchup=False) as dag:

    @task
    def gate() -> str:
        return "passed"

    @task
    def publish(answer: dict) -> list:
        return answer["chosen_options"]

    approve = ApprovalStep(task_id="approve", subject="Publish?", body="the gate passed")
    gate() >> approve
    publish(approve.output)
