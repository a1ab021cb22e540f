"""The factory's typed configs: the config form builds the DAG the older flat keywords build, each flat
keyword warns naming its new home, a flat keyword beside its config is refused, and each config checks
its own fields with a message naming the field, the value and what is allowed."""

from __future__ import annotations

import datetime as dt
import json
import warnings

import pytest
from airflow.sdk import Param

from dtrain.errors import SpecError
from dtrain.pipeline import DataConfig, GateConfig, PublishConfig, TrainingConfig, retraining_pipeline
from dtrain.pipeline.gate import Gate

from .test_params import render

COMMAND = ["python", "-m", "pkg.train", "--shards", "{shards}", "--output", "{output}", "--init-from", "{init_from}",
           "--epochs", "{params.epochs}", "--heldout", "{heldout}"]
PARAMS = {"epochs": Param(4, type="integer", minimum=1, maximum=10), "lr": Param(0.1, type="number", maximum=1)}

#: every flat keyword the factory had (and a train operator argument), with a value other than its default
FLAT = dict(
    raw="s3://b/raw", processed="s3://b/processed", shared_fs="/shared", transform="pkg.prep:transform",
    pack={"field": "input_ids", "block_size": 64, "separator": 1}, dataset_version="v2", aws_conn_id="team_aws",
    epoch_seconds=60,
    train_command=COMMAND, params=PARAMS, nodes=2, procs_per_node=4, backend="ssh", backends=("local", "ssh"),
    backend_options={"ssh": {"conn_id": "gpu_hosts"}}, deepspeed_config={"train_micro_batch_size_per_gpu": 8},
    env={"FOO": "1"}, min_free_gb=0.5, earlier_dates_check_seconds=45, hang_timeout=600,
    evaluate="pkg.eval:evaluate", metric="rmse", goal="minimize", threshold=2.0, min_improvement=0.0,
    heldout="s3://b/heldout/{version}/{partition}.csv", approval=True, approval_timeout=dt.timedelta(hours=2),
    models="/models", model_name="model.bin",
)
CONFIGS = dict(
    data=DataConfig(raw="s3://b/raw", processed="s3://b/processed", shared_fs="/shared", transform="pkg.prep:transform",
                    pack={"field": "input_ids", "block_size": 64, "separator": 1}, dataset_version="v2",
                    aws_conn_id="team_aws", epoch_seconds=60),
    training=TrainingConfig(command=COMMAND, params=PARAMS, nodes=2, procs_per_node=4, backend="ssh",
                            backends=("local", "ssh"), backend_options={"ssh": {"conn_id": "gpu_hosts"}},
                            deepspeed_config={"train_micro_batch_size_per_gpu": 8}, env={"FOO": "1"}, min_free_gb=0.5,
                            earlier_dates_check_seconds=45, operator_args={"hang_timeout": 600}),
    gate=GateConfig(evaluate="pkg.eval:evaluate", metric="rmse", goal="minimize", threshold=2.0, min_improvement=0.0,
                    heldout="s3://b/heldout/{version}/{partition}.csv", approval=True,
                    approval_timeout=dt.timedelta(hours=2)),
    publish=PublishConfig(models="/models", model_name="model.bin"),
)
DAG_ARGS = dict(schedule=None, max_active_runs=2, tags=["team"])


def shape(dag) -> dict:
    """What a DAG is made of, as comparable values: its tasks, their order, their arguments, its params."""
    tasks = {}
    for task in dag.tasks:
        if hasattr(task, "partial_kwargs"):  # a mapped task: its arguments before expansion
            arguments = {k: repr(v) for k, v in task.partial_kwargs.items()}
        else:
            arguments = {name: repr(getattr(task, name, None)) for name in task.template_fields}
        tasks[task.task_id] = {"type": type(task).__name__, "upstream": sorted(task.upstream_task_ids),
                               "arguments": arguments, "retries": task.retries}
    train = dag.get_task("train")
    return {"tasks": tasks, "order": list(dag.task_dict),
            "params": {name: (dag.params.get_param(name).value, dag.params.get_param(name).schema)
                       for name in dag.params},
            "train": {"hang_timeout": train.hang_timeout, "pre_execute": train._pre_execute_hook.__name__,
                      "recheck_s": train._pre_execute_hook.__self__.recheck_s},
            "approve_timeout": getattr(dag.task_dict.get("approve"), "response_timeout", None),
            "dag": (dag.schedule, dag.max_active_runs, sorted(dag.tags), dag.default_args)}


def rendered(dag) -> dict:
    """What a run renders: the ranks' argv and environment, where it stages, what evaluate gets."""
    conf = {"epochs": 3.0}
    train = render(dag.get_task("train"), conf)
    stage = render(dag.get_task("stage"), conf)
    return {"argv": train.command, "run_dir": train.run_dir, "env": json.loads(train.env),
            "deepspeed": train.deepspeed_config, "stage": (stage.source, stage.destination, stage.nodes),
            "evaluate": render(dag.get_task("evaluate"), conf).op_kwargs}


def test_the_flat_keywords_and_the_configs_build_the_same_dag():
    with pytest.warns(DeprecationWarning):
        flat = retraining_pipeline("same", **FLAT, **DAG_ARGS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        typed = retraining_pipeline("same", **CONFIGS, **DAG_ARGS)
    assert not [w for w in caught if "retraining_pipeline(" in str(w.message)]  # the config form warns of nothing
    assert shape(typed) == shape(flat)
    assert rendered(typed) == rendered(flat)
    # and the values came through (a shape both forms lost would compare equal too)
    assert rendered(typed)["argv"] == [
        "python", "-m", "pkg.train", "--shards", "/shared/d",
        "--output", "/shared/runs/same/v2/2026-01-01/run-0/model.bin", "--init-from", "", "--epochs", "3",
        "--heldout", "s3://b/heldout/v2/2026-01-01.csv"]
    assert rendered(typed)["env"] == {"FOO": "1"}
    assert typed.get_task("preprocess").partial_kwargs["pack"] == {"field": "input_ids", "block_size": 64,
                                                                    "separator": 1}
    train = typed.get_task("train")
    assert (train.hang_timeout, train.backend_options, train.aws_conn_id) == (600, {"ssh": {"conn_id": "gpu_hosts"}},
                                                                             "team_aws")
    assert typed.params.get_param("backend").schema["enum"] == ["local", "ssh"]
    assert typed.get_task("approve").response_timeout == dt.timedelta(hours=2)
    assert shape(typed)["train"]["recheck_s"] == 45


def test_the_publish_config_is_optional_and_the_gate_without_approval_publishes_directly():
    dag = retraining_pipeline("minimal", data=CONFIGS["data"], training=TrainingConfig(command=["python", "t.py"]),
                              gate=GateConfig(evaluate="pkg.eval:evaluate", metric="f1", goal="maximize"))
    assert "approve" not in dag.task_dict and dag.get_task("gate").downstream_task_ids == {"publish"}
    assert render(dag.get_task("evaluate"), {}).op_kwargs["model_path"] == \
        "/shared/runs/minimal/v2/2026-01-01/run-0/model.pt"


@pytest.mark.parametrize("keyword, value, message", [
    ("metric", "f1", "retraining_pipeline(metric=...) is deprecated: use gate=GateConfig(metric=...)"),
    ("raw", "s3://b/raw", "retraining_pipeline(raw=...) is deprecated: use data=DataConfig(raw=...)"),
    ("train_command", ["python", "t.py"],
     "retraining_pipeline(train_command=...) is deprecated: use training=TrainingConfig(command=...)"),
    ("model_name", "m.pt",
     "retraining_pipeline(model_name=...) is deprecated: use publish=PublishConfig(model_name=...)"),
    ("hang_timeout", 600, "retraining_pipeline(hang_timeout=...) is deprecated: use "
                          "training=TrainingConfig(operator_args={'hang_timeout': ...})"),
])
def test_a_flat_keyword_warns_naming_its_new_home(keyword, value, message):
    configs = {name: config for name, config in CONFIGS.items() if name != {
        "metric": "gate", "raw": "data", "train_command": "training", "model_name": "publish",
        "hang_timeout": "training"}[keyword]}
    flat = {"metric": {"evaluate": "pkg.eval:evaluate", "goal": "maximize"}, "raw": {
        "processed": "s3://b/p", "shared_fs": "/shared", "transform": "pkg.prep:transform"},
        "hang_timeout": {"train_command": ["python", "t.py"]}}.get(keyword, {})  # the rest of that config
    with pytest.warns(DeprecationWarning) as record:
        retraining_pipeline(f"warns_{keyword}", **configs, **{keyword: value}, **flat)
    messages = [str(w.message) for w in record]
    assert message in messages
    assert [w.filename for w in record if str(w.message) == message] == [__file__]  # points at the caller's line


@pytest.mark.parametrize("keyword, value, argument", [
    ("metric", "f1", "gate"), ("raw", "s3://other", "data"), ("train_command", ["python", "x.py"], "training"),
    ("hang_timeout", 600, "training"), ("registry", None, "publish"),
])
def test_a_flat_keyword_beside_its_config_is_refused_naming_both(keyword, value, argument):
    with pytest.raises(SpecError) as err:
        retraining_pipeline("mixed", **CONFIGS, **{keyword: value})
    cls = type(CONFIGS[argument]).__name__
    assert err.value.field == keyword
    assert f"not both retraining_pipeline({keyword}=...) and {argument}={cls}(...)" in str(err.value)


@pytest.mark.parametrize("build, message", [
    (lambda: DataConfig(raw="s3://b/raw", processed="s3://b/p", shared_fs="/s", transform="pkg/prep.py"),
     "transform='pkg/prep.py' is invalid: a literal import path MODULE:FUNCTION, e.g. mypkg.eval:evaluate "
     "(imported where the task runs, not when the DAG is parsed)"),
    (lambda: DataConfig(raw="", processed="s3://b/p", shared_fs="/s", transform="pkg.prep:t"),
     "raw='' is invalid: a URL or path (a non-empty string)"),
    (lambda: DataConfig(raw="s3://b/raw", processed="s3://b/p", shared_fs="/s", transform="pkg.prep:t",
                        dataset_version="v 1"),
     "dataset_version='v 1' is invalid: a version name: a letter or digit, then up to 63 of letters, digits, . _ -"),
    (lambda: TrainingConfig(command="python train.py"),
     "command='python train.py' is invalid: a non-empty list of strings (argv: no shell)"),
    (lambda: TrainingConfig(command=["python", "t.py"], backend="k8s"),
     "backend='k8s' is invalid: one of backends (local, ssh, slurm)"),
    (lambda: TrainingConfig(command=["python", "t.py"], earlier_dates_check_seconds=0),
     "earlier_dates_check_seconds=0 is invalid: a number of seconds from 1 to 3600"),
    (lambda: TrainingConfig(command=["python", "t.py"], params={"nodes": 3}),
     "params='nodes' is invalid: a name other than the built-in params nodes, procs_per_node, distribution, "
     "backend, dataset_version"),
    (lambda: GateConfig(evaluate="pkg.eval:evaluate", metric="rmse", goal="lower"),
     "goal='lower' is invalid: maximize or minimize"),
    (lambda: GateConfig(evaluate="pkg.eval:evaluate", metric="rmse", goal="minimize", approval_timeout=3600),
     "approval_timeout=3600 is invalid: a positive datetime.timedelta, or None"),
    (lambda: PublishConfig(model_name="../model.pt"),
     "model_name='../model.pt' is invalid: a file or directory name (letters, digits, _ . + -)"),
])
def test_a_config_checks_its_own_fields(build, message):
    with pytest.raises(SpecError) as err:
        build()
    assert str(err.value) == message


def test_a_gate_rule_is_not_a_gate_config():
    """The gate argument needs the evaluate function too: a bare Gate is refused, saying what is wanted."""
    with pytest.raises(SpecError) as err:
        retraining_pipeline("bare", data=CONFIGS["data"], training=CONFIGS["training"],
                            gate=Gate(metric="rmse", goal="minimize"))
    assert err.value.field == "gate" and err.value.allowed == "a dtrain.pipeline.GateConfig(...)"
    assert CONFIGS["gate"].rule == Gate(metric="rmse", goal="minimize", threshold=2.0, min_improvement=0.0)


def test_a_missing_config_is_named():
    with pytest.raises(SpecError) as err:
        retraining_pipeline("none", data=CONFIGS["data"], gate=CONFIGS["gate"])
    assert err.value.field == "training" and err.value.value is None
