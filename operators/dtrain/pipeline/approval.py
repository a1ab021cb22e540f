"""The pipeline's approval step: Airflow's ApprovalOperator, safe for an answer that comes at once.

Airflow 3.3.1 and 3.3.2 race when an answer lands right after the task parked in
``awaiting_input`` (as an automated approver that polls the task and PATCHes at once does;
tests/pipeline/test_early_approval.py): the answer re-queues the task under the same executor
key, and when the scheduler handles that re-queue in the same loop as the parked worker's exit,
the exit's "success" event finds the task queued, no longer tracked by the executor, and the
scheduler fails the try ("finished with state success, but the task instance's state attribute is
queued").

The answer itself survives that failure: the request row (HITL detail) follows the task instance
to its next try. So :class:`ApprovalStep` has one retry, a second later, that does not ask again
and does not park either: parking with an answer already stored resumes at once, in the same
scheduler loop as that worker's exit, and loses the same race every time. The retry defers instead,
to :class:`KeptAnswerTrigger` (on the triggerer, which the provider's deferrable launches need
anyway): it reads the stored answer only after SETTLE_SECONDS, when the scheduler has long
processed the deferring worker's exit, and resumes the task with it. A timeout stays final: no
answer, no publish, no second wait.

Limit: a first try that failed before it asked (a worker lost before the request was written)
also gets this retry, which finds no request and fails instead of asking again: the same outcome
as without the retry (the run fails, nothing is published).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.providers.standard.triggers.hitl import HITLTrigger

#: one retry: the try the scheduler fails in the race above, completed with the answer it kept
RETRIES = 1
RETRY_DELAY = dt.timedelta(seconds=1)
#: how long the retry's trigger waits before it reads the stored answer: the scheduler processes the
#: deferring worker's exit within a loop or two, seconds even on a loaded host
SETTLE_SECONDS = 10.0


class KeptAnswerTrigger(HITLTrigger):
    """Airflow's HITLTrigger (resume with the request's answer, or time out), starting to read only
    after ``settle_seconds`` (see the module)."""

    def __init__(self, *, settle_seconds: float = SETTLE_SECONDS, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.settle_seconds = settle_seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        return f"{type(self).__module__}.{type(self).__qualname__}", {**kwargs, "settle_seconds": self.settle_seconds}

    async def run(self):
        await asyncio.sleep(self.settle_seconds)
        async for event in super().run():
            yield event


class ApprovalStep(ApprovalOperator):
    """ApprovalOperator whose retry completes with the answer an earlier try received (see the module)."""

    def __init__(self, **kwargs: Any) -> None:
        # Fixed, whatever the DAG's default_args say (merged into kwargs before this runs): the
        # retry exists for the race only.
        super().__init__(**{**kwargs, "retries": RETRIES, "retry_delay": RETRY_DELAY})

    def execute(self, context) -> Any:
        ti = context["task_instance"]
        if ti.try_number <= 1:
            return super().execute(context)
        from airflow.sdk.timezone import utcnow

        self.log.info("A retry of the approval: resuming with the answer the earlier try received "
                      "(not asking again), read in %.0f s", SETTLE_SECONDS)
        self.defer(trigger=KeptAnswerTrigger(
            ti_id=ti.id, options=self.options, defaults=self.defaults, params=self.serialized_params,
            multiple=self.multiple,
            timeout_datetime=utcnow() + self.response_timeout if self.response_timeout else None),
            method_name="execute_complete")

    def process_trigger_event_error(self, event: dict[str, Any]) -> None:
        from airflow.providers.standard.exceptions import HITLTimeoutError
        from airflow.sdk.exceptions import AirflowFailException

        try:
            super().process_trigger_event_error(event)
        except HITLTimeoutError as e:  # final: the retry exists for the race only
            raise AirflowFailException("no answer to the approval request"
                                       + (f" within {self.response_timeout}" if self.response_timeout else "")
                                       + " (an unanswered request is never published)") from e
