"""retrain_pipeline: the digits demo, built with the pipeline factory (dtrain.pipeline.retraining_pipeline).

Where data and models live comes from the environment (dtrain/pipeline/config.py:
DTRAIN_RAW_URL, DTRAIN_PROCESSED_URL, DTRAIN_SHARED_FS, DTRAIN_AWS_CONN_ID, ...).
"""

from __future__ import annotations

import json
import os

from airflow.sdk import DAG, Param, get_current_context, task

from dtrain.pipeline import DataConfig, GateConfig, PublishConfig, TrainingConfig, model_asset, retraining_pipeline
from dtrain.pipeline.config import load_config
from dtrain.pipeline.params import FINITE

CFG = load_config()

dag = retraining_pipeline(
    "retrain_pipeline",
    data=DataConfig(raw=CFG.raw_url, processed=CFG.processed_url, shared_fs=CFG.shared_fs,
                    transform="dtrain.preprocess.examples:digits_features", aws_conn_id=CFG.aws_conn_id,
                    epoch_seconds=30),
    training=TrainingConfig(
        command=["python", "-m", "dtrain.training.reference.train_digits", "--shards", "{shards}",
                 "--epochs", "{params.epochs}", "--base-lr", "{params.base_lr}",
                 "--init-from", "{init_from}", "--output", "{output}"],
        params={"epochs": Param(20, type="integer", minimum=1, maximum=500, title="Epochs"),
                "base_lr": Param(0.05, type="number", exclusiveMinimum=0, maximum=10, **FINITE,
                                 title="Base learning rate",
                                 description="Learning rate at a global batch of 32, scaled linearly with the "
                                             "global batch (nodes x procs x 32), with warmup.")},
        nodes=2, procs_per_node=2,
        deepspeed_config={"train_micro_batch_size_per_gpu": 32, "zero_optimization": {"stage": 2},
                          "steps_per_print": 1000000},
        backend_options={"ssh": {"conn_id": CFG.ssh_conn_id}}, min_free_gb=0.5),
    gate=GateConfig(evaluate="dtrain.training.reference.digits_eval:evaluate", metric="accuracy", goal="maximize",
                    threshold=0.9),
    publish=PublishConfig(models=CFG.models_root),
    schedule=CFG.schedule, start_date=CFG.start_date, catchup=CFG.catchup,
    max_active_runs=int(os.environ.get("DTRAIN_RETRAIN_MAX_ACTIVE_RUNS", "1")),
)

TRAINED_MODEL = model_asset("retrain_pipeline")

with DAG(dag_id="evaluate_published_model", schedule=[TRAINED_MODEL], start_date=CFG.start_date, catchup=False,
         tags=["dtrain", "evaluation"],
         doc_md="Runs whenever retrain_pipeline publishes a model: re-evaluates it, writes evaluation.json beside it."):

    @task
    def evaluate_new_models() -> list[dict]:
        from dtrain.training.reference.digits_eval import evaluate

        reports = []
        for event in get_current_context()["triggering_asset_events"][TRAINED_MODEL]:
            path = event.extra["model_path"]
            report = {"model_path": path, **evaluate(path), "dataset_version": event.extra["dataset_version"],
                      "partition": event.extra["partition"]}
            out = os.path.join(os.path.dirname(path), "evaluation.json")
            with open(out + ".tmp", "w", encoding="utf-8") as fh:
                json.dump(report, fh)
            os.replace(out + ".tmp", out)
            print(f"evaluated {path}: accuracy {report['accuracy']}")
            reports.append(report)
        return reports

    evaluate_new_models()
