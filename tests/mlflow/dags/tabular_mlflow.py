"""The example pipeline (examples/tabular) with MLflow as its registry, for tests/mlflow's end-to-end
test: the example's own arguments, MlflowRegistry as in its tabular_retraining_mlflow DAG, and one
test-only change: the train command goes through tests/mlflow/flaky.py, so that a run can make its
first train try fail (param fail_first_try) and the retry resume the same MLflow run. (airflow dag)"""

import datetime as dt
import importlib.util
import os

from airflow.sdk import Param

from dtrain.pipeline import retraining_pipeline
from dtrain.pipeline.registry_mlflow import MlflowRegistry

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
_spec = importlib.util.spec_from_file_location(
    "tabular_retraining_example", os.path.join(REPO, "examples", "tabular", "dags", "tabular_retraining.py"))
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)

PIPELINE = dict(_example.PIPELINE)
PIPELINE["train_command"] = ["python", os.path.join(os.path.dirname(HERE), "flaky.py"), "{run_dir}",
                             "{params.fail_first_try}", "--", *PIPELINE["train_command"]]
PIPELINE["params"] = {**PIPELINE["params"], "fail_first_try": Param(False, type="boolean")}

dag = retraining_pipeline(
    "tabular_mlflow", schedule=None, approval=True, max_active_runs=2,
    registry=MlflowRegistry(os.environ.get("TABULAR_MLFLOW_MODEL", "tabular-rmse"), conn_id="mlflow_default",
                            load_model="tabular_pipeline.evaluate:load_model"),
    default_args={"retries": 1, "retry_delay": dt.timedelta(seconds=1)}, **PIPELINE)
