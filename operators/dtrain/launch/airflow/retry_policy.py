"""Airflow's side of :mod:`dtrain.launch.engine.retry`: a ``RetryPolicy`` the training operator uses by default.

Airflow 3.3 evaluates a task's ``retry_policy`` in the worker, with the exception the task
raised (``airflow/sdk/execution_time/task_runner.py``: ``_handle_current_task_failed``): ``FAIL``
ends the task at once whatever ``retries`` says, ``RETRY`` retries (still bounded by
``retries``) and stores the reason on the task instance (``retry_reason``), ``DEFAULT`` leaves
the decision to ``retries``. The scheduler never sees the policy object: a serialized DAG
only records that the task has one.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import RetryDecision, RetryPolicy

from dtrain.launch.engine.retry import FAIL, RETRY, classify


class TrainingRetryPolicy(RetryPolicy):
    """Bad input fails at once; preemption, a lost node, a communication error or a hang retries."""

    def evaluate(self, exception: BaseException, try_number: int, max_tries: int,
                 context: Any = None) -> RetryDecision:
        verdict = classify(exception)
        if verdict.action == FAIL:
            return RetryDecision.fail(verdict.reason)
        if verdict.action == RETRY:
            return RetryDecision.retry(reason=verdict.reason)
        return RetryDecision.default()

    def serialize(self) -> dict[str, Any]:
        return {"__type": f"{type(self).__module__}.{type(self).__qualname__}"}

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> "TrainingRetryPolicy":
        return cls()

    def __eq__(self, other: object) -> bool:  # stateless: any two are the same policy
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))
