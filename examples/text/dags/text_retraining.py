"""A team's own language-model retraining DAG: JSON-lines text in, held-out perplexity out, built with dtrain's
pipeline factory.

text_retraining: daily; tokenizes the day's documents (the example's own BPE tokenizer), packs them into
64-token blocks, trains a small causal transformer on 2 ranks with DDP, and publishes it only when its
held-out perplexity is below the bar and no worse than the published model's. text_retraining_mlflow:
the same, triggered by hand, with MLflow as the model registry and tracker (the `mlflow_default`
connection; docs/mlflow.md): each version carries the tokenizer its model was trained with.
"""

import datetime as dt
import os

from airflow.sdk import Param

from dtrain.mlflow.registry import MlflowRegistry
from dtrain.pipeline import DataConfig, GateConfig, PublishConfig, TrainingConfig, retraining_pipeline

BUCKET = os.environ.get("TEXT_BUCKET", "s3://text-demo")
SHARED_FS = os.environ.get("TEXT_SHARED_FS", "/fsx")
# text_pipeline.tokenizer.EOS_ID, written out: parsing this file must not import the tokenizer (or numpy).
EOS_ID = 1
BLOCK_SIZE = 64

DATA = DataConfig(raw=f"{BUCKET}/raw", processed=f"{BUCKET}/processed", shared_fs=SHARED_FS,
                  transform="text_pipeline.prep:transform",
                  pack={"field": "input_ids", "block_size": BLOCK_SIZE, "separator": EOS_ID})
TRAINING = TrainingConfig(
    command=["python", "-m", "text_pipeline.train", "--shards", "{shards}", "--output", "{output}",
             "--init-from", "{init_from}", "--epochs", "{params.epochs}", "--lr", "{params.lr}"],
    params={"epochs": Param(4, type="integer", minimum=1, maximum=200, title="Epochs"),
            "lr": Param(0.003, type="number", exclusiveMinimum=0, maximum=1, title="Learning rate")},
    nodes=1, procs_per_node=2, min_free_gb=0.1)
GATE = GateConfig(evaluate="text_pipeline.evaluate:evaluate", heldout=f"{BUCKET}/heldout/{{version}}/heldout.jsonl",
                  metric="perplexity", goal="minimize", threshold=50.0, min_improvement=0.0)
START = dt.datetime(2026, 2, 1, tzinfo=dt.timezone.utc)

dag = retraining_pipeline("text_retraining", data=DATA, training=TRAINING, gate=GATE, schedule="@daily",
                          start_date=START)
# Consumers load mlflow.pytorch.load_model("models:/text-lm@champion") (the package's code travels in the
# version) and read the tokenizer from the version's artifacts/tokenizer: text_pipeline.train writes the
# tokenizer the model was trained with beside it in the run directory, as tokenizer.json.
mlflow_dag = retraining_pipeline(
    "text_retraining_mlflow", data=DATA, training=TRAINING, gate=GATE, schedule=None, start_date=START,
    publish=PublishConfig(registry=MlflowRegistry("text-lm", conn_id="mlflow_default",
                                                  load_model="text_pipeline.model:load", requirements=["tokenizers"],
                                                  artifacts={"tokenizer": "tokenizer.json"})))
