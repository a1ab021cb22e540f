"""The pipeline's approval step: Airflow's ApprovalOperator, safe for an answer that comes at once.

Airflow 3.3.1 and 3.3.2 race when an answer lands right after the task parked in
``awaiting_input`` (as an automated approver that polls the task and PATCHes at once does;
tests/pipeline/test_early_approval.py): the answer re-queues the task under the same executor
key while the scheduler has not yet processed the parked worker's exit; that exit's "success"
event then finds the task queued, no longer tracked by the executor, and the scheduler fails the
try ("finished with state success, but the task instance's state attribute is queued").

The answer itself survives that failure: the request row (HITL detail) stays attached to the task
instance, and the scheduler's timeout sweep resumes a parked task whose request holds an answer
with that answer. So :class:`ApprovalStep` has one retry, a second later, and the retry does not ask
again (that would reset the stored answer): it parks with a deadline of KEPT_ANSWER_DEADLINE, and
the sweep (every ``[scheduler] trigger_timeout_check_interval``, 15 s by default) then resumes it
with the earlier answer. The deadline is not shorter because a resume is an answer too: one that
comes before the scheduler has processed the retry's own exit loses the same race (seen here with
a one-second deadline). A timeout stays final: no answer, no publish, no second wait.

Limit: a first try that failed before it asked (a worker lost before the request was written)
also gets this retry, which then finds no stored answer and fails with "no answer" instead of
asking again: the same outcome as without the retry (the run fails, nothing is published).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator

#: one retry: the try the scheduler fails in the race above, completed with the answer it kept
RETRIES = 1
RETRY_DELAY = dt.timedelta(seconds=1)
#: how long a retry parks before the scheduler's sweep hands it the stored answer: long enough for
#: the scheduler to have processed the parked worker's exit first (see the module)
KEPT_ANSWER_DEADLINE = dt.timedelta(seconds=20)


class ApprovalStep(ApprovalOperator):
    """ApprovalOperator whose retry completes with the answer an earlier try received (see the module)."""

    def __init__(self, **kwargs: Any) -> None:
        # Fixed, whatever the DAG's default_args say (merged into kwargs before this runs): the
        # retry exists for the race only, and a later one would only wait longer.
        super().__init__(**{**kwargs, "retries": RETRIES, "retry_delay": RETRY_DELAY})

    def execute(self, context) -> Any:
        if context["task_instance"].try_number <= 1:
            return super().execute(context)
        from airflow.sdk.exceptions import TaskAwaitingInput

        self.log.info("A retry of the approval: waiting for the scheduler to hand over the answer the "
                      "earlier try received (not asking again)")
        raise TaskAwaitingInput(method_name="execute_complete", timeout=KEPT_ANSWER_DEADLINE)

    def process_trigger_event_error(self, event: dict[str, Any]) -> None:
        from airflow.providers.standard.exceptions import HITLTimeoutError
        from airflow.sdk.exceptions import AirflowFailException

        try:
            super().process_trigger_event_error(event)
        except HITLTimeoutError as e:  # final: the retry exists for the race only
            raise AirflowFailException("no answer to the approval request"
                                       + (f" within {self.response_timeout}" if self.response_timeout else "")
                                       + " (an unanswered request is never published)") from e
