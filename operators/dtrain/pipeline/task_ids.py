"""The retraining DAG's task ids and the XCom keys read across tasks, in one place.

The factory (:mod:`dtrain.pipeline.factory`) names its tasks with these, the templates it builds pull
XComs by them, and the UI (:mod:`dtrain.ui.store`) reads a run's results by them: a renamed task
cannot leave a reader behind. Standard library only, so that the UI imports it without Airflow's SDK.
"""

from __future__ import annotations


def pull(task_id: str) -> str:
    """The Jinja expression for ``task_id``'s return value in this run (index it for one field)."""
    return f"ti.xcom_pull(task_ids={task_id!r})"


#: the XCom key under which GATE pushes its decision (Decision.as_dict), read by APPROVE's body, PUBLISH and the UI
DECISION_KEY = "decision"

CHECK_PARAMS = "check_params"
LIST_RAW_INPUTS = "list_raw_inputs"
PREPROCESS = "preprocess"
FINALIZE_DATASET = "finalize_dataset"
STAGE = "stage"
PREFLIGHT = "preflight"
TRAIN = "train"
EVALUATE = "evaluate"
GATE = "gate"
APPROVE = "approve"
PUBLISH = "publish"
