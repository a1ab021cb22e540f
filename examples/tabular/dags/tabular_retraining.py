"""A team's own retraining DAGs: tabular regression, CSV in, RMSE out, built with dtrain's pipeline factory.

tabular_retraining: daily; publishes a model only when its held-out RMSE is no worse than the
published one's. tabular_retraining_reviewed: the same, triggered by hand, and a person approves
each model the gate passes before it is published. tabular_retraining_mlflow: the reviewed pipeline
with MLflow as the model registry and tracker (the `mlflow_default` connection; docs/mlflow.md).
"""

import dataclasses
import datetime as dt
import os

from airflow.sdk import Param

from dtrain.mlflow.registry import MlflowRegistry
from dtrain.pipeline import DataConfig, GateConfig, PublishConfig, TrainingConfig, retraining_pipeline

BUCKET = os.environ.get("TABULAR_BUCKET", "s3://tabular-demo")
SHARED_FS = os.environ.get("TABULAR_SHARED_FS", "/fsx")

DATA = DataConfig(raw=f"{BUCKET}/raw", processed=f"{BUCKET}/processed", shared_fs=SHARED_FS,
                  transform="tabular_pipeline.prep:transform")
TRAINING = TrainingConfig(
    command=["python", "-m", "tabular_pipeline.train", "--shards", "{shards}", "--output", "{output}",
             "--init-from", "{init_from}", "--epochs", "{params.epochs}", "--lr", "{params.lr}"],
    params={"epochs": Param(4, type="integer", minimum=1, maximum=200, title="Epochs"),
            "lr": Param(0.01, type="number", exclusiveMinimum=0, maximum=1, title="Learning rate")},
    nodes=1, procs_per_node=2, min_free_gb=0.1)
GATE = GateConfig(evaluate="tabular_pipeline.evaluate:evaluate", heldout=f"{BUCKET}/heldout/{{version}}/heldout.csv",
                  metric="rmse", goal="minimize", threshold=2.0, min_improvement=0.0)
REVIEWED = dataclasses.replace(GATE, approval=True)
START = dt.datetime(2026, 2, 1, tzinfo=dt.timezone.utc)

dag = retraining_pipeline("tabular_retraining", data=DATA, training=TRAINING, gate=GATE,
                          schedule="@daily", start_date=START)
# Two runs at once: while one waits for its reviewer, the next one preprocesses and stages its date
# (its train waits for the answer, so that it warm-starts from the model that was or was not published).
reviewed_dag = retraining_pipeline("tabular_retraining_reviewed", data=DATA, training=TRAINING, gate=REVIEWED,
                                   schedule=None, start_date=START, max_active_runs=2)
# Consumers load what serves with mlflow.pytorch.load_model("models:/tabular-rmse@champion").
mlflow_dag = retraining_pipeline("tabular_retraining_mlflow", data=DATA, training=TRAINING, gate=REVIEWED,
                                 publish=PublishConfig(registry=MlflowRegistry(
                                     "tabular-rmse", conn_id="mlflow_default",
                                     load_model="tabular_pipeline.evaluate:load_model")),
                                 schedule=None, start_date=START, max_active_runs=2)
