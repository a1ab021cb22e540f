"""A test plugin (tests/pipeline/test_early_approval.py) that makes a worker as slow as one on a
loaded host, in the order in which Airflow 3.3.1 and 3.3.2 fail a run whose approval is answered
at once: the process that parked ``early_approval.approve`` exits PARK_EXIT_DELAY_S after it
reported ``awaiting_input`` (so the answer lands first), and the process resuming it is still
running when the scheduler processes that exit (RESUME_DELAY_S before it starts its work)."""

from __future__ import annotations

import os
import time

from airflow.listeners import hookimpl
from airflow.plugins_manager import AirflowPlugin

SLOW = ("early_approval", "approve")
PARK_EXIT_DELAY_S = 3.0
RESUME_DELAY_S = 10.0
_this_process: dict[str, int] = {}


def nth_process() -> int:
    """1 for the first process that runs the task, 2 for the second, ... (counted with files
    created exclusively in AIRFLOW_HOME: each task process is a fresh interpreter)."""
    for n in range(1, 100):
        try:
            os.close(os.open(os.path.join(os.environ["AIRFLOW_HOME"], f"approve-process-{n}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return n
        except FileExistsError:
            continue
    return 100


class SlowWorker:
    @hookimpl
    def on_task_instance_running(self, previous_state, task_instance):
        if (task_instance.dag_id, task_instance.task_id) == SLOW:
            _this_process["n"] = nth_process()
            if _this_process["n"] == 2:
                time.sleep(RESUME_DELAY_S)

    @hookimpl
    def before_stopping(self, component):
        if _this_process.get("n") == 1:
            time.sleep(PARK_EXIT_DELAY_S)


class SlowWorkerPlugin(AirflowPlugin):
    name = "dtrain_test_slow_worker"
    listeners = [SlowWorker()]
