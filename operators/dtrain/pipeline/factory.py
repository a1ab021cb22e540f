"""Your own retraining DAG from one call: :func:`retraining_pipeline`.

    from airflow.sdk import Param
    from dtrain.pipeline import DataConfig, GateConfig, TrainingConfig, retraining_pipeline

    dag = retraining_pipeline(
        "tabular_retraining",
        data=DataConfig(raw="s3://acme-raw/tabular", processed="s3://acme-processed", shared_fs="/fsx",
                        transform="tabular_pipeline.prep:transform"),
        training=TrainingConfig(
            command=["python", "-m", "tabular_pipeline.train", "--shards", "{shards}", "--output", "{output}",
                     "--init-from", "{init_from}", "--epochs", "{params.epochs}"],
            params={"epochs": Param(5, type="integer", minimum=1, maximum=100)}),
        gate=GateConfig(evaluate="tabular_pipeline.evaluate:evaluate",
                        heldout="s3://acme-raw/tabular-heldout/{version}.csv",
                        metric="rmse", goal="minimize", min_improvement=0.0),
    )

The DAG: check_params -> list_raw_inputs -> preprocess (mapped, one task per raw file) ->
finalize_dataset -> stage -> preflight -> train -> evaluate -> gate -> [approve] -> publish.

Guarantees, whatever the model:

* every path is keyed by pipeline (dag_id), dataset version and the run's data-interval
  partition, so backfilled dates never write into each other;
* a retry of the train task resumes from its own checkpoints (same run directory); clearing
  the run (a rerun) trains afresh in ``run-<clear_number>``;
* ``{init_from}`` is the last model published before the run's partition (warm start), and the
  gate compares with the same model, whatever the backfill's concurrency: ``train`` starts only
  once no run of an earlier date is still running (:func:`retraining_pipeline`, *Ordering*);
* a partition with no raw data skips its run with a message saying so (nothing trained or published);
* run params are validated by JSON schema when a run is triggered (UI, REST, backfill), then by
  ``check_params`` (types converted, unknown keys and too many local ranks refused) before any
  data is read; every task gets them from the run itself (:func:`retraining_pipeline`, *Params*);
* publish is atomic and updates the pipeline's model asset (:func:`model_asset`).

How it is built: :func:`retraining_pipeline` takes its configs (:mod:`dtrain.pipeline.configs`, each
checked when built), resolves them once into a frozen :class:`PipelineArgs` (:func:`pipeline_args`),
opens the DAG and calls one builder per step (``add_check_params`` ... ``add_publish``, each adding
its own task), then chains them in one place: adding a step is one builder and one line there.
Task ids and the XCom keys read across tasks are :mod:`dtrain.pipeline.task_ids`, which the UI
reads runs by.

Parsing stays cheap: this module imports airflow.sdk and the operators' thin modules only;
the user's transform, training and evaluate code is imported where it runs, never here.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from airflow.sdk import DAG, Asset, Param, chain, get_current_context, task

from dtrain.launch.airflow.operator import DistributedTrainingOperator
from dtrain.paths import pipeline_run_dir
from dtrain.pipeline.config import partition_of
from dtrain.pipeline.configs import DataConfig, GateConfig, PublishConfig, TrainingConfig, configs_from_keywords
from dtrain.pipeline.gate import Gate
from dtrain.pipeline.params import (DATASET_VERSION_PATTERN, FINITE, MAX_RANKS_ENV, NODES_PATTERN, NODES_TYPE,
                                    OVERSUBSCRIPTION, checked_values)
from dtrain.pipeline.placeholders import (LITERAL_MACRO, PARAMS_MACRO, RUN_PARAMS, literal_text, param_jinja,
                                          param_value, to_jinja)
from dtrain.pipeline.registry import DirectoryRegistry, ModelRegistry, Pipeline, RunRef
from dtrain.pipeline.task_ids import (APPROVE, CHECK_PARAMS, DECISION_KEY, EVALUATE, FINALIZE_DATASET, GATE,
                                      LIST_RAW_INPUTS, PREFLIGHT, PREPROCESS, PUBLISH, STAGE, TRAIN, pull)
from dtrain.preflight.operator import PreflightOperator
from dtrain.preprocess.operator import PreprocessFinalizeOperator, PreprocessOperator
from dtrain.preprocess.packing import Packing
from dtrain.staging.operator import StageToSharedFSOperator

#: a pipeline's tasks retry once, this long after a failure (default_args may say otherwise)
RETRY_DELAY = dt.timedelta(seconds=10)

VERSION = param_jinja("dataset_version")
PART = "{{ dtrain_partition(dag_run) }}"


def model_asset(dag_id: str) -> Asset:
    """The asset a pipeline updates when it publishes a model (schedule other DAGs on it).

    Its identity depends only on the pipeline's name: locations travel in each event's extra
    (model_path, metrics_path, dataset_version, partition), not in the URI."""
    return Asset(name=f"{dag_id}_model", uri=f"dtrain://{dag_id}/model")


def dataset_asset(dag_id: str) -> Asset:
    """The asset a pipeline updates when it has staged a dataset on the shared filesystem."""
    return Asset(name=f"{dag_id}_staged_dataset", uri=f"dtrain://{dag_id}/staged_dataset")


def _builtin_params(nodes: int, procs_per_node: int, backend: str, backends: Sequence[str],
                    distributions: Sequence[str], dataset_version: str) -> dict[str, Param]:
    return {
        "nodes": Param(nodes, type=NODES_TYPE, minimum=1, maximum=64, pattern=NODES_PATTERN, title="Nodes",
                       description="Nodes to train on (simulated on one host with backend=local), or MIN:MAX "
                                   "for an elastic job that goes on while at least MIN are left (local, ssh, slurm)."),
        "procs_per_node": Param(procs_per_node, type="integer", minimum=1, maximum=16, title="Processes per node",
                                description="Training processes per node: the GPU count on GPU nodes."),
        "distribution": Param(distributions[0], type="string", enum=list(distributions), title="Distribution",
                              description="pytorch = DDP through torchrun; deepspeed = the pipeline's DeepSpeed "
                                          "config."),
        "backend": Param(backend, type="string", enum=list(backends), title="Backend",
                         description=f"local = this worker (nodes x procs_per_node: at most {OVERSUBSCRIPTION} per "
                                     f"CPU core or GPU, or {MAX_RANKS_ENV}); ssh = the hosts of the pipeline's SSH "
                                     "connection; slurm = sbatch."),
        "dataset_version": Param(dataset_version, type="string", pattern=DATASET_VERSION_PATTERN,
                                 title="Dataset version", description="Raw data under <raw>/<version>/<partition>/."),
    }


def _user_params(params: Mapping[str, Any] | None) -> dict[str, Param]:
    """The user's params (their names checked by :class:`TrainingConfig`) as Params; numbers refuse NaN."""
    out: dict[str, Param] = {}
    for name, value in (params or {}).items():
        param = copy.copy(value) if isinstance(value, Param) else Param(value)
        if param.schema.get("type") == "number" and "not" not in param.schema:
            param.schema = {**param.schema, **FINITE}  # NaN passes every JSON-schema comparison
        out[name] = param
    return out


class WarmStart:
    """``{init_from}`` and the *Ordering* of :func:`retraining_pipeline`: the macro that renders the
    warm start (remembering what it rendered in this process), and train's ``pre_execute``."""

    def __init__(self, registry: ModelRegistry, recheck_s: float) -> None:
        self.registry = registry
        self.recheck_s = recheck_s
        self.rendered: dict[tuple[str, str], str] = {}  # what this process rendered as {init_from}

    def __deepcopy__(self, memo) -> WarmStart:
        return self  # one record per DAG: a copy of train (DAG.partial_subset) checks what the DAG's macro rendered

    def previous(self, version: str, partition: str) -> str:
        """The ``dtrain_previous_model`` macro: the newest model published before ``partition``."""
        self.rendered[(version, partition)] = found = self.registry.warm_start(version, partition)
        return found

    def wait_for_earlier_dates(self, context) -> None:
        """train's pre_execute (after its templates are rendered): see *Ordering* in :func:`retraining_pipeline`."""
        from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException

        from dtrain.pipeline.steps import EarlierDateBlocking, EarlierDateRunning, check_earlier_dates

        ti = context["ti"]
        key = (context["params"]["dataset_version"], partition_of(context["dag_run"]))
        try:
            check_earlier_dates(ti.get_previous_dagrun(state="running"), ti.get_previous_dagrun(state="queued"),
                                ti.get_previous_dagrun())
            # The argv was rendered just before this check: an earlier date that published in between
            # makes it stale, and the next try renders it again.
            if key in self.rendered and self.registry.warm_start(*key) != self.rendered[key]:
                raise EarlierDateRunning("a model of an earlier date was published while train was being rendered")
        except EarlierDateRunning as e:
            print(f"{e}; checking again in {self.recheck_s:g} s")
            raise AirflowRescheduleException(
                dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=self.recheck_s)) from None
        except EarlierDateBlocking as e:
            raise AirflowFailException(str(e)) from None
        print(f"train: no run of an earlier date is running; warm start from {self.rendered.get(key) or 'nothing'}")


@dataclass(frozen=True, eq=False)
class PipelineArgs:
    """:func:`retraining_pipeline`'s configs resolved once (:func:`pipeline_args`): what every step builder reads.

    Text fields marked Jinja are templates a task renders per run (paths keyed by version and partition)."""

    dag_id: str
    raw: str
    processed_url: str  # Jinja: <processed>/<dag_id>/<version>/<partition>
    shared_fs: str
    transform: str
    packing: Packing | None
    evaluate: str
    heldout: str  # Jinja: what evaluate gets as its held-out location ("" for none)
    gate: Gate
    registry: ModelRegistry  # bound to this pipeline
    params: Mapping[str, Param]  # built-in and user params
    schemas: Mapping[str, Mapping[str, Any]]  # each param's JSON schema
    backend_options: Mapping[str, Mapping[str, Any]]
    deepspeed_json: str  # the DeepSpeed config as JSON, "" without one
    env: Mapping[str, str]
    run_dir: str  # Jinja
    output: str  # Jinja: {output}
    argv: Sequence[str]  # Jinja: the training command with its placeholders replaced
    aws_conn_id: str | None
    approval: bool
    approval_timeout: dt.timedelta | None
    min_free_gb: float
    epoch_seconds: float | None
    operator_args: Mapping[str, Any]  # TrainingConfig.operator_args
    warm_start: WarmStart

    def __deepcopy__(self, memo) -> PipelineArgs:
        return self  # frozen, and what a task's copy holds (a bound method) must be the pipeline's own

    def run_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The ``dtrain_params`` macro: the run's params checked and converted as ``check_params`` does
        (``2.0`` -> ``2``), from the run's params themselves (see *Params* in :func:`retraining_pipeline`)."""
        return checked_values(params, self.schemas)

    def deepspeed_config(self, params: Mapping[str, Any]) -> str:
        """The ``dtrain_deepspeed_config`` macro: the config's JSON when the run chose DeepSpeed, else ''."""
        return self.deepspeed_json if params["distribution"] == "deepspeed" else ""


def _run_ref(context) -> RunRef:
    dag_run = context["dag_run"]
    return RunRef(run_id=dag_run.run_id, clear_number=dag_run.clear_number or 0,
                  version=context["params"]["dataset_version"], partition=partition_of(dag_run))


def _macros(a: PipelineArgs) -> dict[str, Any]:
    """The DAG's user-defined macros, which the steps' templates call."""

    def train_env(ti) -> str:
        from dtrain.preflight.checks import checked_nccl_env

        recommended = checked_nccl_env((ti.xcom_pull(task_ids=PREFLIGHT) or {}).get("nccl_env"))
        return json.dumps({**recommended, **a.env})

    def approval_body(ti) -> str:
        from dtrain.pipeline.report import approval_markdown

        return approval_markdown(ti.xcom_pull(task_ids=EVALUATE), ti.xcom_pull(task_ids=GATE, key=DECISION_KEY))

    return {"dtrain_partition": partition_of, "dtrain_previous_model": a.warm_start.previous,
            "dtrain_deepspeed_config": a.deepspeed_config, "dtrain_train_env": train_env,
            "dtrain_approval_body": approval_body, LITERAL_MACRO: literal_text, PARAMS_MACRO: a.run_params}


# -- the steps: one builder per task, in the DAG's order; retraining_pipeline chains them --------------

def add_check_params(a: PipelineArgs):
    """check_params: the run's params checked beyond their schemas, on this worker, before anything else."""

    # No retry: bad params stay bad. Runs before any data is read, preprocessed or staged.
    @task(task_id=CHECK_PARAMS, retries=0)
    def check_params() -> dict:
        """Check the run's params beyond their schemas, on this worker, before anything else runs."""
        from dtrain.pipeline.params import check_launch
        from dtrain.pipeline.params import check_params as check

        values = check(get_current_context()["params"], a.schemas)
        placement = check_launch(values, a.backend_options, a.deepspeed_config(values))
        print(f"check_params: {json.dumps(values)}; world size {placement.world_size} on backend={placement.backend}")
        return values

    return check_params()


def add_list_raw_inputs(a: PipelineArgs):
    """list_raw_inputs: the partition's raw files (none: the run is skipped)."""

    # No retry: a partition with no data skips its run at once (a run on unpause, a date
    # without data in a backfill: not a failure) and frees the run slot.
    @task(task_id=LIST_RAW_INPUTS, retries=0)
    def list_raw_inputs(raw_url: str) -> list[str]:
        """The raw files of this run's partition: one mapped preprocessing task each."""
        from airflow.sdk.exceptions import AirflowSkipException

        from dtrain.pipeline.steps import NoRawData
        from dtrain.pipeline.steps import list_raw_inputs as find

        try:
            return find(raw_url, a.aws_conn_id)
        except NoRawData as e:
            raise AirflowSkipException(f"{e}: this run is skipped (nothing trained or published). Upload "
                                       "the partition's files there and clear this run to train it") from None

    return list_raw_inputs(f"{a.raw.rstrip('/')}/{VERSION}/{PART}/")


def add_preprocess(a: PipelineArgs, raw_inputs):
    """preprocess: the transform over each raw file (a mapped task per file)."""
    return PreprocessOperator.partial(
        task_id=PREPROCESS, transform=a.transform, output_path=a.processed_url, aws_conn_id=a.aws_conn_id,
        pack=a.packing and a.packing.as_dict(),
    ).expand(input=raw_inputs)


def add_finalize_dataset(a: PipelineArgs, preprocessed):
    """finalize_dataset: the mapped tasks' shards made one dataset (its manifest)."""
    return PreprocessFinalizeOperator(task_id=FINALIZE_DATASET, output_path=a.processed_url,
                                      partitions=preprocessed.output, aws_conn_id=a.aws_conn_id)


def add_stage(a: PipelineArgs):
    """stage: the dataset mirrored onto the shared filesystem; updates the staged-dataset asset."""
    return StageToSharedFSOperator(
        task_id=STAGE, source=f"{a.processed_url}/", destination=os.path.join(a.shared_fs, "datasets", a.dag_id,
                                                                              VERSION),
        dataset_version=PART, aws_conn_id=a.aws_conn_id, epoch_seconds=a.epoch_seconds,
        nodes=param_jinja("nodes"), outlets=[dataset_asset(a.dag_id)],
    )


def _placement(a: PipelineArgs) -> dict[str, Any]:
    """What preflight and train share: where the ranks run."""
    return {"nodes": param_jinja("nodes"), "procs_per_node": param_jinja("procs_per_node"),
            "backend": param_jinja("backend"), "backend_options": a.backend_options}


def add_preflight(a: PipelineArgs):
    """preflight: every node checked (dataset, free space, network) before the job starts."""
    return PreflightOperator(
        task_id=PREFLIGHT, manifest_path="{{ " + pull(STAGE) + "['manifest_path'] }}",
        checkpoint_dir=a.run_dir, min_free_gb=a.min_free_gb, **_placement(a),
    )


def add_train(a: PipelineArgs):
    """train: the distributed job (an MLflow run too when the registry tracks runs); waits for earlier dates."""
    tracked = {"registry": a.registry, "run_params": a.run_params} if a.registry.tracks_runs else {}
    # the registry's own class where it has one (dtrain.mlflow.operator): the pipeline never imports it
    train_class = a.registry.train_operator_class() or DistributedTrainingOperator
    return train_class(
        task_id=TRAIN, command=list(a.argv), distribution=param_jinja("distribution"),
        deepspeed_config="{{ dtrain_deepspeed_config(" + RUN_PARAMS + ") }}", env="{{ dtrain_train_env(ti) }}",
        run_dir=a.run_dir, aws_conn_id=a.aws_conn_id, pre_execute=a.warm_start.wait_for_earlier_dates,
        **_placement(a), **tracked, **a.operator_args,
    )


def add_evaluate(a: PipelineArgs, trained):
    """evaluate: the user's evaluate(model_path, heldout) on the trained model, recorded with the registry."""

    @task(task_id=EVALUATE)
    def evaluate_model(result: dict, model_path: str, heldout_location: str | None) -> dict:
        """Run the pipeline's evaluate(model_path, heldout) on the trained model."""
        from dtrain.pipeline.steps import evaluate_model as run
        from dtrain.preprocess.operator import aws_credentials_env
        from dtrain.preprocess.transform import resolve

        function = resolve(a.evaluate, field="evaluate")
        with aws_credentials_env(a.aws_conn_id):
            metrics = run(function, model_path, heldout_location or None, a.gate.metric)
        print(f"evaluate: {json.dumps(metrics, sort_keys=True)} (model {model_path})")
        evaluation = {"metrics": metrics, "model_path": model_path, "heldout": heldout_location or None,
                      "run_dir": result["run_dir"], "training": result.get("metrics") or {},
                      "world_size": result.get("world_size"), "duration_s": result.get("duration_s")}
        a.registry.record_evaluation(_run_ref(get_current_context()), evaluation)
        return evaluation

    return evaluate_model(trained.output, model_path=a.output, heldout_location=a.heldout)


def add_gate(a: PipelineArgs, evaluation):
    """gate: a branch to approve (or publish) when the model passes, to nothing when it does not."""
    next_step = APPROVE if a.approval else PUBLISH

    @task.branch(task_id=GATE)
    def gate_model(evaluation: dict) -> str | None:
        """Compare the metric with the bar and the published model; publish (or ask) only if it passes."""
        from dtrain.pipeline.steps import decide_with

        context = get_current_context()
        decision = decide_with(a.gate, evaluation["metrics"], a.registry, context["params"]["dataset_version"],
                               partition_of(context["dag_run"]))
        print(decision.summary)
        context["ti"].xcom_push(key=DECISION_KEY, value=decision.as_dict())
        return next_step if decision.publish else None

    return gate_model(evaluation)


def add_approve(a: PipelineArgs):
    """approve: a person's answer (Airflow's ApprovalOperator) before a model the gate passed is published."""
    from dtrain.pipeline.approval import ApprovalStep

    return ApprovalStep(task_id=APPROVE, subject=f"Publish the {a.dag_id} model for {PART}?",
                        body="{{ dtrain_approval_body(ti) }}", response_timeout=a.approval_timeout)


def add_publish(a: PipelineArgs, evaluation):
    """publish: the model published with the registry; updates the model asset."""
    model = model_asset(a.dag_id)

    @task(task_id=PUBLISH, outlets=[model])
    def publish_model(evaluation: dict) -> dict:
        """Publish the model with the registry (default: atomically under <models>/<dag_id>/<version>/<partition>/)
        and update the asset."""
        context = get_current_context()
        ti = context["ti"]
        version, partition = context["params"]["dataset_version"], partition_of(context["dag_run"])
        record = {"pipeline": a.dag_id, "dataset_version": version, "partition": partition,
                  "run_id": context["dag_run"].run_id, "evaluation": evaluation["metrics"],
                  "gate": ti.xcom_pull(task_ids=GATE, key=DECISION_KEY), "training": evaluation["training"],
                  "run_dir": evaluation["run_dir"], "heldout": evaluation["heldout"],
                  "world_size": evaluation["world_size"], "trained_model": evaluation["model_path"]}
        if a.approval:
            answer = ti.xcom_pull(task_ids=APPROVE) or {}
            record["approval"] = {"chosen_options": answer.get("chosen_options"),
                                  "responded_by": answer.get("responded_by_user")}
        published = a.registry.publish(_run_ref(context), evaluation["model_path"], record)
        context["outlet_events"][model].extra = {**published.asset_extra, "dataset_version": version,
                                                 "partition": partition}
        print(f"PUBLISHED {published.summary} ({a.gate.metric} {evaluation['metrics'][a.gate.metric]})")
        return published.record

    return publish_model(evaluation)


def pipeline_args(dag_id: str, data: DataConfig, training: TrainingConfig, gate: GateConfig,
                  publish: PublishConfig) -> PipelineArgs:
    """The configs (each already checked) resolved once into what the step builders read: params,
    registry and the per-run templates; a placeholder naming no param fails here, naming its field."""
    registry = (publish.registry or DirectoryRegistry()).for_pipeline(
        Pipeline(dag_id, data.shared_fs, publish.model_name, publish.models))
    distributions = ["pytorch"] + (["deepspeed"] if training.deepspeed_config else [])
    all_params: dict[str, Param] = {**_builtin_params(training.nodes, training.procs_per_node, training.backend,
                                                      training.backends, distributions, data.dataset_version),
                                    **_user_params(training.params)}

    run_dir = pipeline_run_dir(data.shared_fs, dag_id, VERSION, PART, "{{ dag_run.clear_number or 0 }}")
    templates = {
        "shards": "{{ " + pull(STAGE) + "['destination'] }}",
        "output": os.path.join(run_dir, publish.model_name),
        "init_from": "{{ dtrain_previous_model(" + param_value("dataset_version") + ", dtrain_partition(dag_run)) }}",
        "run_dir": run_dir,
        "checkpoint_dir": os.path.join(run_dir, "checkpoints"),
        "version": VERSION,
        "partition": PART,
    }

    def heldout_jinja(for_ranks: bool) -> str | None:
        return None if gate.heldout is None else to_jinja(
            gate.heldout, "heldout", {k: templates[k] for k in ("version", "partition")}, all_params, for_ranks)

    heldout_text = heldout_jinja(for_ranks=False)  # what evaluate gets
    templates["heldout"] = heldout_jinja(for_ranks=True) or ""  # what the ranks get
    return PipelineArgs(
        dag_id=dag_id, raw=data.raw, processed_url=f"{data.processed.rstrip('/')}/{dag_id}/{VERSION}/{PART}",
        shared_fs=data.shared_fs, transform=data.transform, packing=data.packing, evaluate=gate.evaluate,
        heldout=heldout_text or "", gate=gate.rule, registry=registry, params=all_params,
        schemas={name: param.schema for name, param in all_params.items()},
        backend_options={k: dict(v) for k, v in (training.backend_options or {}).items()},
        deepspeed_json=json.dumps(dict(training.deepspeed_config)) if training.deepspeed_config else "",
        env=dict(training.env or {}), run_dir=run_dir, output=templates["output"],
        argv=[to_jinja(arg, f"command[{i}]", templates, all_params, for_ranks=True)
              for i, arg in enumerate(training.command)],
        aws_conn_id=data.aws_conn_id, approval=gate.approval, approval_timeout=gate.approval_timeout,
        min_free_gb=training.min_free_gb, epoch_seconds=data.epoch_seconds,
        operator_args=dict(training.operator_args or {}),
        warm_start=WarmStart(registry, float(training.earlier_dates_check_seconds)),
    )


def retraining_pipeline(
    dag_id: str,
    *,
    data: DataConfig | None = None,
    training: TrainingConfig | None = None,
    gate: GateConfig | None = None,
    publish: PublishConfig | None = None,
    schedule: Any = "@daily",
    start_date: dt.datetime | None = None,
    catchup: bool = False,
    max_active_runs: int = 1,
    default_args: Mapping[str, Any] | None = None,
    tags: Sequence[str] = (),
    doc_md: str | None = None,
    **deprecated: Any,
) -> DAG:
    """Build a retraining DAG for your model; everything model-specific is in its four configs.

    Args:
        dag_id: the DAG's id; also keys every path and the model asset.
        data: where the raw data is, how it is preprocessed and where it is staged (:class:`DataConfig`).
        training: the command every rank runs, its params and placement (:class:`TrainingConfig`).
        gate: how the trained model is evaluated and when it is published (:class:`GateConfig`).
        publish: where models are published (:class:`PublishConfig`; default: ``<shared_fs>/models``).
        schedule, start_date, catchup, max_active_runs, default_args, tags, doc_md: as for a DAG
            (default_args default to one retry after 10 s). A run's partition is its logical date:
            Airflow 3 reads ``"@daily"`` as a trigger timetable (the run at 00:00 of D is D's);
            ``CronDataIntervalTimetable("@daily", timezone="UTC")`` runs D once D has ended (the
            README's *Schedule and backfill*).
        **deprecated: the older flat keywords (``raw=``, ``metric=``, ``hang_timeout=`` ...), one
            release more: each warns (DeprecationWarning) naming its place in a config
            (:func:`dtrain.pipeline.configs.configs_from_keywords`); one beside its config is refused.

    Returns:
        The DAG (registered by being a module-level name of a DAG file).

    Ordering: a run's warm start (``{init_from}``, rendered when ``train`` starts) and its gate
    baseline must be the newest model published before its date, even when a backfill runs its
    dates at once (Airflow's backfills ignore the DAG's ``max_active_runs``: they have their own,
    10 by default). So ``train`` checks first (its ``pre_execute``) that no run of an earlier date
    is still running; if one is, it is rescheduled (Airflow's ``up_for_reschedule``: no worker slot
    held) and checks again every ``TrainingConfig.earlier_dates_check_seconds``, logging which run
    it waits for. Everything before ``train`` (listing, preprocessing, staging, preflight) runs ahead.
    Why not ``depends_on_past``: Airflow then refuses every backfill created without
    ``--reprocess-behavior`` (the recipe users copy), and ``wait_for_downstream`` looks one task
    downstream only, not at the previous date's ``publish``. An earlier run that failed, or one
    still queued (which a waiting run could starve of its run slot), fails ``train`` at once with
    a message saying how to go on (:func:`dtrain.pipeline.steps.check_earlier_dates`).

    Params: built-in and user params reach every template one way, ``{{ dtrain_params(params)[NAME] }}``
    (:func:`dtrain.pipeline.placeholders.param_jinja`): the run's params, fixed when it was
    triggered, converted as ``check_params`` converts them (:func:`dtrain.pipeline.params.checked_values`;
    ``2.0`` -> ``2``). Not from ``check_params``' XCom: the REST API lets whoever may edit the DAG
    change an XCom, and a value changed there would skip the schemas and ``check_params``' limits.
    ``check_params`` still runs first, on its worker, and fails the run before any data is touched.
    """
    configs = configs_from_keywords({"data": data, "training": training, "gate": gate, "publish": publish},
                                    deprecated)
    a = pipeline_args(dag_id, **configs)
    with DAG(
        dag_id=dag_id,
        schedule=schedule,
        start_date=start_date,
        catchup=catchup,
        max_active_runs=max_active_runs,
        params=a.params,
        user_defined_macros=_macros(a),
        default_args={"retries": 1, "retry_delay": RETRY_DELAY, **(default_args or {})},
        tags=["dtrain", "retraining", *tags],
        doc_md=doc_md or __doc__.split("\n\n", 1)[0],
    ) as dag:
        # One line a step. Data flows where a builder takes an upstream's output; chain() adds the
        # order the module docstring shows (an edge a data dependency already made is kept once).
        checked = add_check_params(a)
        raw_inputs = add_list_raw_inputs(a)
        preprocessed = add_preprocess(a, raw_inputs)
        dataset = add_finalize_dataset(a, preprocessed)
        staged = add_stage(a)
        preflight = add_preflight(a)
        trained = add_train(a)
        evaluation = add_evaluate(a, trained)
        decided = add_gate(a, evaluation)
        published = add_publish(a, evaluation)
        approved = [add_approve(a)] if a.approval else []
        chain(checked, raw_inputs, preprocessed, dataset, staged, preflight, trained, evaluation, decided, *approved,
              published)
    return dag
