"""The example pipeline (examples/tabular) with MLflow as its registry, for tests/mlflow's end-to-end
test: the example's own arguments, MlflowRegistry as in its tabular_retraining_mlflow DAG, and one
test-only change: the train command goes through tests/mlflow/flaky.py, so that a run can make its
first train try fail (param fail_first_try) and the retry resume the same MLflow run. (airflow dag)"""

import dataclasses
import datetime as dt
import importlib.util
import os

from airflow.sdk import Param

from dtrain.pipeline import PublishConfig, retraining_pipeline
from dtrain.mlflow.registry import MlflowRegistry

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

def _example_module():
    """The example's DAG file as a module, its own DAGs not registered as this file's: Airflow
    registers every DAG built while a DAG file is imported (auto_register), so they would run here too."""
    from airflow.sdk.definitions._internal.contextmanager import DagContext

    spec = importlib.util.spec_from_file_location(
        "tabular_retraining_example", os.path.join(REPO, "examples", "tabular", "dags", "tabular_retraining.py"))
    module = importlib.util.module_from_spec(spec)
    importing, DagContext.current_autoregister_module_name = DagContext.current_autoregister_module_name, None
    try:
        spec.loader.exec_module(module)
    finally:
        DagContext.current_autoregister_module_name = importing
    return module


_example = _example_module()

TRAINING = dataclasses.replace(
    _example.TRAINING,
    command=["python", os.path.join(os.path.dirname(HERE), "flaky.py"), "{run_dir}", "{params.fail_first_try}", "--",
             *_example.TRAINING.command],
    params={**_example.TRAINING.params, "fail_first_try": Param(False, type="boolean")})

dag = retraining_pipeline(
    "tabular_mlflow", data=_example.DATA, training=TRAINING, gate=_example.REVIEWED,
    publish=PublishConfig(registry=MlflowRegistry(os.environ.get("TABULAR_MLFLOW_MODEL", "tabular-rmse"),
                                                  conn_id="mlflow_default",
                                                  load_model="tabular_pipeline.evaluate:load_model")),
    schedule=None, start_date=_example.START, max_active_runs=2,
    default_args={"retries": 1, "retry_delay": dt.timedelta(seconds=1)})
