"""The retry probe of bench/elastic.py: what an Airflow retry itself costs, between a try that failed and
the next try's user code.

One task, ``retries=1``, ``retry_delay`` as a pipeline from the factory has it (``RETRY_DELAY``, 10 s): its
first try fails at once, its second succeeds at once. Each
try appends a line to the file ``params.out`` (JSON: try, event ``start`` when its callable begins and
``fail`` just before it raises, the wall-clock time), which the bench reads next to the tries' start and
end dates from the REST API. The DAG file imports the training operator, as a training DAG does, so the
retry's task process parses what a real one parses.
"""

from __future__ import annotations

import json
import time
from datetime import datetime

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG, Param

import dtrain.launch.airflow.operator  # noqa: F401 (parse-time cost of a training DAG)
from dtrain.pipeline.factory import RETRY_DELAY

DAG_ID, TASK_ID = "bench_retry_probe", "probe"


def _note(out: str, try_number: int, event: str) -> None:
    with open(out, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"try": try_number, "event": event, "time": time.time()}) + "\n")


def probe(**context) -> None:
    out, try_number = context["params"]["out"], context["ti"].try_number
    _note(out, try_number, "start")
    if try_number == 1:
        _note(out, try_number, "fail")
        raise RuntimeError("retry probe: the first try fails")


with DAG(dag_id=DAG_ID, schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         params={"out": Param("/nonexistent", type="string")},
         default_args={"retries": 1, "retry_delay": RETRY_DELAY}):
    PythonOperator(task_id=TASK_ID, python_callable=probe)
