"""retrain_pipeline: check_params -> preprocess -> stage -> preflight -> train -> evaluate -> publish.

Scheduled (``@daily`` by default), triggered from the UI with parameters, or backfilled
over past dates. Every path a run touches is keyed by dataset version and the run's
data-interval partition (operators/dtrain/pipeline/config.py), so retries resume from their own
checkpoint, backfills never overwrite each other, and each run warm-starts from the last
model published before its date. Where data and models live comes from the environment
(DTRAIN_RAW_URL, DTRAIN_PROCESSED_URL, DTRAIN_SHARED_FS, DTRAIN_AWS_CONN_ID, ...).

Parsing stays cheap: only airflow.sdk and the operators' thin modules are imported here.
"""

from __future__ import annotations

import datetime as dt
import json
import os

from airflow.sdk import DAG, Asset, Param, get_current_context, task

from dtrain.launch.operator import DistributedTrainingOperator
from dtrain.pipeline.config import load_config, partition_of
from dtrain.pipeline.params import DATASET_VERSION_PATTERN, FINITE, MAX_RANKS_ENV, OVERSUBSCRIPTION
from dtrain.pipeline.publish import previous_model
from dtrain.preflight.operator import PreflightOperator
from dtrain.preprocess.operator import PreprocessFinalizeOperator, PreprocessOperator
from dtrain.staging.operator import StageToSharedFSOperator

CFG = load_config()
# Asset identity must not depend on a worker's environment (two URIs under one name make
# Airflow deactivate one): the locations travel in each asset event's extra instead.
STAGED_DATASET = Asset(name="dtrain_staged_dataset", uri="dtrain://retrain_pipeline/staged_dataset")
TRAINED_MODEL = Asset(name="dtrain_trained_model", uri="dtrain://retrain_pipeline/trained_model")

VERSION = "{{ params.dataset_version }}"
PART = "{{ partition(dag_run) }}"
# A retry of the run keeps clear_number and so resumes from its checkpoints; clearing the run
# (a rerun, e.g. a backfill with --reprocess-behavior completed) trains afresh in a new directory.
RUN_DIR = os.path.join(CFG.runs_root, VERSION, PART, "run-{{ dag_run.clear_number or 0 }}")
BACKEND_OPTIONS = {"ssh": {"conn_id": CFG.ssh_conn_id}}

# The schemas are enforced when a run is triggered (UI, REST, backfill: a 400, no run); FINITE
# refuses NaN, and DATASET_VERSION_PATTERN's end anchor a trailing newline (dtrain/pipeline/params.py).
# The first task, check_params, does what a schema cannot: converts 2.0 to 2, refuses unknown
# keys and checks the worker's limits (backend=local ranks) before any data is touched.
# Integer params are rendered with `| int`: a JSON-schema integer may arrive as 2.0.
PARAMS = {
    "nodes": Param(2, type="integer", minimum=1, maximum=64, title="Nodes",
                   description="Nodes to train on (simulated on one host with backend=local)."),
    "procs_per_node": Param(2, type="integer", minimum=1, maximum=16, title="Processes per node",
                            description="Training processes per node: the GPU count on GPU nodes."),
    "distribution": Param("pytorch", type="string", enum=["pytorch", "deepspeed"], title="Distribution",
                          description="pytorch = DDP through torchrun; deepspeed = ZeRO stage 2."),
    "epochs": Param(20, type="integer", minimum=1, maximum=500, title="Epochs"),
    "base_lr": Param(0.05, type="number", exclusiveMinimum=0, maximum=10, **FINITE, title="Base learning rate",
                     description="Learning rate at a global batch of 32; scaled linearly with the global "
                                 "batch (nodes x procs x 32), with warmup. The scaled rate is in the train log."),
    "dataset_version": Param("v1", type="string", pattern=DATASET_VERSION_PATTERN,
                             title="Dataset version", description="Raw data under <raw>/<version>/<date>/."),
    "backend": Param("local", type="string", enum=["local", "ssh", "slurm"], title="Backend",
                     description=f"local = this host (nodes x procs_per_node: at most {OVERSUBSCRIPTION} per CPU "
                                 f"core or GPU of the worker, or {MAX_RANKS_ENV}); ssh = hosts of the "
                                 "DTRAIN_SSH_CONN_ID connection; slurm = sbatch."),
    "min_accuracy": Param(0.9, type="number", minimum=0, maximum=1, **FINITE, title="Minimum test accuracy to publish"),
}


def deepspeed_config(params) -> str:
    """The ZeRO-2 config when distribution is deepspeed; '' otherwise (the operator then passes none)."""
    if params["distribution"] != "deepspeed":
        return ""
    return json.dumps({"train_micro_batch_size_per_gpu": 32, "zero_optimization": {"stage": 2},
                       "steps_per_print": 1000000})


with DAG(
    dag_id="retrain_pipeline",
    schedule=CFG.schedule,
    start_date=CFG.start_date,
    catchup=CFG.catchup,
    max_active_runs=int(os.environ.get("DTRAIN_RETRAIN_MAX_ACTIVE_RUNS", "1")),
    params=PARAMS,
    user_defined_macros={"partition": partition_of, "previous_model": previous_model,
                         "deepspeed_config": deepspeed_config, "models_root": CFG.models_root},
    default_args={"retries": 1, "retry_delay": dt.timedelta(seconds=10)},
    tags=["dtrain", "retraining"],
    doc_md=__doc__,
) as dag:

    # No retry: bad params stay bad. Cheap: runs before any data is read, preprocessed or staged.
    @task(retries=0)
    def check_params() -> dict:
        """Check the run's params beyond their schemas, on this worker, before anything else runs."""
        from dtrain.pipeline.params import check_launch
        from dtrain.pipeline.params import check_params as check

        values = check(get_current_context()["params"], {name: param.schema for name, param in PARAMS.items()})
        spec = check_launch(values, BACKEND_OPTIONS, deepspeed_config(values))
        print(f"check_params: {json.dumps(values)}; world size {spec.world_size} on backend={spec.backend}")
        return values

    # No retry: a partition with no data fails at once and frees the run slot; rerun it once data lands.
    @task(retries=0)
    def list_raw_inputs(raw_url: str) -> list[str]:
        """The raw files of this run's partition: one mapped preprocessing task each."""
        import fsspec

        from dtrain.staging.operator import aws_storage_options

        options = aws_storage_options(CFG.aws_conn_id) if raw_url.startswith("s3://") else {}
        fs, root = fsspec.core.url_to_fs(raw_url, **options)
        protocol = raw_url.split("://", 1)[0] + "://" if "://" in raw_url else ""
        files = sorted(p for p in fs.find(root) if not os.path.basename(p).startswith("."))
        if not files:
            raise FileNotFoundError(f"no raw data at {raw_url}: nothing to train on for this partition")
        return [protocol + p if protocol and not p.startswith(protocol) else p for p in files]

    checked = check_params()
    raw_inputs = list_raw_inputs(f"{CFG.raw_url}/{VERSION}/{PART}/")

    preprocess = PreprocessOperator.partial(
        task_id="preprocess", transform=CFG.transform, output_path=f"{CFG.processed_url}/{VERSION}/{PART}",
        aws_conn_id=CFG.aws_conn_id,
    ).expand(input=raw_inputs)

    dataset = PreprocessFinalizeOperator(
        task_id="finalize_dataset", output_path=f"{CFG.processed_url}/{VERSION}/{PART}", partitions=preprocess.output,
        aws_conn_id=CFG.aws_conn_id,
    )

    stage = StageToSharedFSOperator(
        task_id="stage", source=f"{CFG.processed_url}/{VERSION}/{PART}/",
        destination=os.path.join(CFG.datasets_root, VERSION), dataset_version=PART,
        aws_conn_id=CFG.aws_conn_id, epoch_seconds=30, nodes="{{ params.nodes | int }}", outlets=[STAGED_DATASET],
    )

    common = {"nodes": "{{ params.nodes | int }}", "procs_per_node": "{{ params.procs_per_node | int }}",
              "backend": "{{ params.backend }}", "backend_options": BACKEND_OPTIONS}

    preflight = PreflightOperator(
        task_id="preflight", manifest_path="{{ ti.xcom_pull(task_ids='stage')['manifest_path'] }}",
        checkpoint_dir=RUN_DIR, min_free_gb=0.5, **common,
    )

    train = DistributedTrainingOperator(
        task_id="train",
        command=["python", "-m", "dtrain.training.reference.train_digits",
                 "--shards", "{{ ti.xcom_pull(task_ids='stage')['destination'] }}",
                 "--epochs", "{{ params.epochs | int }}", "--base-lr", "{{ params.base_lr }}",
                 "--init-from", "{{ previous_model(models_root, params.dataset_version, partition(dag_run)) }}",
                 "--output", os.path.join(RUN_DIR, "model.pt")],
        distribution="{{ params.distribution }}",
        deepspeed_config="{{ deepspeed_config(params) }}",
        env="{{ ti.xcom_pull(task_ids='preflight')['nccl_env'] | tojson }}",
        run_dir=RUN_DIR,
        **common,
    )

    @task
    def evaluate(result: dict) -> dict:
        """Re-evaluate the saved model on held-out data; refuse to publish below the bar."""
        from dtrain.pipeline.publish import PublishError, evaluate_model

        params = get_current_context()["params"]
        accuracy = evaluate_model(result["metrics"]["model_path"])
        print(f"evaluate: test accuracy {accuracy:.4f} (training reported {result['metrics']['test_accuracy']}, "
              f"bar {params['min_accuracy']})")
        if accuracy < params["min_accuracy"]:
            raise PublishError(f"test accuracy {accuracy:.4f} is below min_accuracy={params['min_accuracy']}")
        return {**result["metrics"], "evaluated_accuracy": round(accuracy, 4), "run_dir": result["run_dir"],
                "duration_s": result["duration_s"]}

    @task(outlets=[TRAINED_MODEL])
    def publish(metrics: dict) -> dict:
        from dtrain.pipeline.publish import publish_model

        context = get_current_context()
        version, partition = context["params"]["dataset_version"], partition_of(context["dag_run"])
        published = publish_model(metrics["model_path"], metrics, CFG.models_root, version, partition)
        context["outlet_events"][TRAINED_MODEL].extra = {
            "model_path": published["model_path"], "metrics_path": published["metrics_path"],
            "dataset_version": version, "partition": partition}
        print(f"PUBLISHED model: {published['model_path']} metrics: {published['metrics_path']} "
              f"(test accuracy {metrics['evaluated_accuracy']})")
        return published

    checked >> raw_inputs >> preprocess
    dataset >> stage >> preflight >> train
    publish(evaluate(train.output))


with DAG(
    dag_id="evaluate_published_model",
    schedule=[TRAINED_MODEL],
    start_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc),
    catchup=False,
    tags=["dtrain", "evaluation"],
    doc_md="Runs whenever retrain_pipeline publishes a model: re-evaluates it and writes evaluation.json beside it.",
) as evaluation_dag:

    @task
    def evaluate_new_models() -> list[dict]:
        from dtrain.pipeline.publish import evaluate_model

        events = get_current_context()["triggering_asset_events"][TRAINED_MODEL]
        reports = []
        for event in events:
            path = event.extra["model_path"]
            report = {"model_path": path, "accuracy": round(evaluate_model(path), 4),
                      "dataset_version": event.extra["dataset_version"], "partition": event.extra["partition"]}
            out = os.path.join(os.path.dirname(path), "evaluation.json")
            with open(out + ".tmp", "w", encoding="utf-8") as fh:
                json.dump(report, fh)
            os.replace(out + ".tmp", out)
            print(f"evaluated {path}: accuracy {report['accuracy']}")
            reports.append(report)
        return reports

    evaluate_new_models()
