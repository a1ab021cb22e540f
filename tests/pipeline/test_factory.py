"""The pipeline factory: what it builds, what it refuses when the DAG is parsed, the argv a run's
train task renders (exact comparison), and publishing/finding models."""

from __future__ import annotations

import copy
import json
import os

import pytest
from airflow.sdk import Param

from dtrain.errors import SpecError
from dtrain.pipeline import retraining_pipeline
from dtrain.pipeline.params import FINITE
from dtrain.pipeline.publish import PublishError, previous_model, previous_published, publish_model

from .test_params import render

BASE = dict(
    raw="s3://b/raw", processed="s3://b/processed", shared_fs="/shared", transform="pkg.prep:transform",
    train_command=["python", "-m", "pkg.train", "--shards", "{shards}", "--output", "{output}",
                   "--init-from", "{init_from}", "--epochs", "{params.epochs}", "--tag", "{version}-{partition}",
                   '--extra={"a": 1}'],
    evaluate="pkg.eval:evaluate", metric="rmse", goal="minimize",
    params={"epochs": Param(4, type="integer", minimum=1, maximum=10), "lr": Param(0.1, type="number", maximum=1)},
)


def build(dag_id: str = "p", **overrides):
    return retraining_pipeline(dag_id, **{**BASE, **overrides})


def test_a_param_value_reaches_the_ranks_as_typed_and_is_never_filled_again(tmp_path):
    """One pass: the factory's placeholders and the launcher's per-rank ones are filled, a param's
    value (from the UI) is not scanned again. A real render of the train task, then a real launch."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.support import rank_records

    value = "x}{run_dir}{rank"
    dump = os.path.join(REPO, "tests", "launch", "scripts", "dump_env.py")
    dag = build("onepass", train_command=["python", dump, "{params.tag}", "{params.tag}}", "--rank={rank}",
                                         "--out={run_dir}/m"],
                params={"tag": Param("t", type="string")})
    command = render(dag.get_task("train"), {"tag": value}).command
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dtrain"), "launch", "--run-dir",
                           str(tmp_path / "run"), f"--env=OUT_DIR={out}", "--", *command],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rank_records(out)[0]["argv"] == [value, value + "}", "--rank=0",
                                            "--out=/shared/runs/onepass/v1/2026-01-01/run-0/m"]


def test_the_dag_chains_every_step_and_approval_sits_between_gate_and_publish():
    dag = build()
    order = ["check_params", "list_raw_inputs", "preprocess", "finalize_dataset", "stage", "preflight", "train",
             "evaluate", "gate", "publish"]
    assert sorted(dag.task_dict) == sorted(order)
    for upstream, downstream in zip(order, order[1:]):
        assert downstream in dag.get_task(upstream).get_flat_relative_ids(upstream=False), (upstream, downstream)
    assert dag.get_task("gate").downstream_task_ids == {"publish"}
    reviewed = build("r", approval=True)
    assert reviewed.get_task("gate").downstream_task_ids == {"approve"}
    approve = reviewed.get_task("approve")  # Airflow's ApprovalOperator, robust to an early answer
    assert type(approve).__name__ == "ApprovalStep" and type(approve).__mro__[1].__name__ == "ApprovalOperator"
    # the retry that completes with the answer the race's try received, whatever default_args say
    assert approve.retries == 1 and approve.retry_delay.total_seconds() == 1
    assert "publish" in reviewed.get_task("approve").downstream_task_ids
    assert [o.name for o in reviewed.get_task("publish").outlets] == ["r_model"]



#: each step builder of the factory and the task ids it adds, in the DAG's order
STEP_BUILDERS = {"add_check_params": {"check_params"}, "add_list_raw_inputs": {"list_raw_inputs"},
                 "add_preprocess": {"preprocess"}, "add_finalize_dataset": {"finalize_dataset"},
                 "add_stage": {"stage"}, "add_preflight": {"preflight"}, "add_train": {"train"},
                 "add_evaluate": {"evaluate"}, "add_gate": {"gate"}, "add_publish": {"publish"},
                 "add_approve": {"approve"}}


def test_each_step_builder_adds_exactly_its_tasks(monkeypatch):
    from airflow.sdk.definitions._internal.contextmanager import DagContext

    from dtrain.pipeline import factory

    assert {name for name in vars(factory) if name.startswith("add_")} == set(STEP_BUILDERS)  # a new step: list it
    added: dict[str, set[str]] = {}

    def watched(name, builder):
        def call(*args):
            dag = DagContext.get_current()
            before = set(dag.task_dict)
            result = builder(*args)
            added[name] = set(dag.task_dict) - before
            return result
        return call

    for name in STEP_BUILDERS:
        monkeypatch.setattr(factory, name, watched(name, getattr(factory, name)))
    build("steps", approval=True)
    assert added == STEP_BUILDERS
    added.clear()
    build("steps_unreviewed")
    assert added == {name: ids for name, ids in STEP_BUILDERS.items() if name != "add_approve"}


def test_the_chain_is_the_documented_order_and_nothing_more():
    """Every task's upstream tasks, as the factory has always wired them (data edges included)."""
    chain = {"check_params": [], "list_raw_inputs": ["check_params"], "preprocess": ["list_raw_inputs"],
             "finalize_dataset": ["preprocess"], "stage": ["finalize_dataset"], "preflight": ["stage"],
             "train": ["preflight"], "evaluate": ["train"], "gate": ["evaluate"], "publish": ["evaluate", "gate"]}
    dag = build()
    assert list(dag.task_dict) == list(chain)
    assert {t: sorted(dag.get_task(t).upstream_task_ids) for t in dag.task_dict} == chain
    reviewed = build("r", approval=True)
    assert list(reviewed.task_dict) == [*chain, "approve"]
    assert {t: sorted(reviewed.get_task(t).upstream_task_ids) for t in reviewed.task_dict} == {
        **chain, "approve": ["gate"], "publish": ["approve", "evaluate"]}


def test_a_run_renders_the_argv_its_ranks_get():
    dag = build("tab")
    train = render(dag.get_task("train"), {"epochs": 3.0})
    assert train.command == [
        "python", "-m", "pkg.train", "--shards", "/shared/d",
        "--output", "/shared/runs/tab/v1/2026-01-01/run-0/model.pt", "--init-from", "",
        "--epochs", "3", "--tag", "v1-2026-01-01", '--extra={"a": 1}']
    assert train.run_dir == "/shared/runs/tab/v1/2026-01-01/run-0"
    assert json.loads(train.env) == {}
    stage = render(dag.get_task("stage"), {})
    assert (stage.source, stage.destination, stage.dataset_version) == (
        "s3://b/processed/tab/v1/2026-01-01/", "/shared/datasets/tab/v1", "2026-01-01")
    evaluate = render(dag.get_task("evaluate"), {})
    assert evaluate.op_kwargs == {"model_path": "/shared/runs/tab/v1/2026-01-01/run-0/model.pt",
                                  "heldout_location": ""}


def test_every_param_a_task_gets_is_the_runs_own_never_a_patched_xcom():
    """A run's params are fixed when it is triggered; an XCom is not (the REST API's PATCH, for whoever
    may edit the DAG), and check_params' limits and the schemas would not hold for a value changed
    there. Built-in and user params alike render from the run's params, converted as check_params does."""
    dag = build("patched", heldout="s3://b/heldout/{version}/{params.epochs}.csv")
    patched = {"check_params": {"nodes": 64, "procs_per_node": 16, "backend": "ssh", "distribution": "deepspeed",
                                "dataset_version": "v9", "epochs": 10 ** 6, "lr": 0.5}}
    conf = {"nodes": 2.0, "epochs": 3.0}
    train = render(dag.get_task("train"), conf, patched)
    assert train.command[train.command.index("--epochs") + 1] == "3"
    assert (train.nodes, train.procs_per_node, train.backend, train.distribution) == ("2", "1", "local", "pytorch")
    assert train.run_dir == "/shared/runs/patched/v1/2026-01-01/run-0" and train.deepspeed_config == ""
    assert render(dag.get_task("stage"), conf, patched).nodes == "2"
    assert render(dag.get_task("evaluate"), conf, patched).op_kwargs["heldout_location"] == \
        "s3://b/heldout/v1/3.csv"


def test_a_patched_preflight_xcom_puts_nothing_but_its_nccl_settings_in_the_ranks_env():
    """Preflight's recommendation reaches every rank's environment through its XCom, which whoever may
    edit the DAG can PATCH: only preflight's own NCCL variables, each with a value of its grammar, pass."""
    dag = build("nccl")
    good = {"preflight": {"nccl_env": {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}}}
    assert json.loads(render(dag.get_task("train"), {}, good).env) == {"NCCL_IB_DISABLE": "1",
                                                                        "NCCL_SOCKET_IFNAME": "eth0"}
    for nccl, field in (({"LD_PRELOAD": "/shared/evil.so"}, "preflight nccl_env"),
                        ({"NCCL_SOCKET_IFNAME": "eth0; rm -rf /"}, "preflight nccl_env['NCCL_SOCKET_IFNAME']"),
                        ({"NCCL_IB_DISABLE": "0\nLD_PRELOAD=/x"}, "preflight nccl_env['NCCL_IB_DISABLE']")):
        with pytest.raises(SpecError) as info:
            render(dag.get_task("train"), {}, {"preflight": {"nccl_env": nccl}})
        assert info.value.field == field


def test_a_copy_of_train_checks_the_warm_start_the_dags_macro_rendered():
    """DAG.partial_subset deep-copies tasks but not the DAG's macros: train's pre_execute must still
    read what dtrain_previous_model recorded (the *Ordering* check), and the MLflow train task's params."""
    from dtrain.pipeline.factory import PipelineArgs, WarmStart

    dag = build("copied")
    macro = dag.user_defined_macros["dtrain_previous_model"].__self__
    assert isinstance(macro, WarmStart)
    copied = dag.partial_subset(["train"], include_upstream=False).get_task("train")
    assert copied._pre_execute_hook.__self__ is macro
    args = dag.user_defined_macros["dtrain_params"].__self__
    assert isinstance(args, PipelineArgs) and copy.deepcopy(args) is args


def test_the_heldout_location_fills_its_own_placeholders():
    dag = build(heldout="s3://b/heldout/{version}/{partition}.csv")
    assert render(dag.get_task("evaluate"), {}).op_kwargs["heldout_location"] == "s3://b/heldout/v1/2026-01-01.csv"
    with pytest.raises(SpecError) as info:
        build(heldout="s3://b/{shards}")  # the shards are not known where the held-out data is
    assert info.value.field == "heldout"


def test_user_number_params_refuse_nan_like_the_builtin_ones():
    dag = build()
    assert dag.params.get_param("lr").schema["not"] == FINITE["not"]
    assert set(dag.params) == {"nodes", "procs_per_node", "distribution", "backend", "dataset_version", "epochs", "lr"}
    assert dag.params.get_param("distribution").schema["enum"] == ["pytorch"]  # no DeepSpeed config given
    assert build(deepspeed_config={"train_micro_batch_size_per_gpu": 8}).params.get_param(
        "distribution").schema["enum"] == ["pytorch", "deepspeed"]


@pytest.mark.parametrize("overrides, field", [
    ({"train_command": ["python", "train.py", "--data", "{shard}"]}, "command[3]"),
    ({"train_command": ["python", "train.py", "{params.epoch}"]}, "command[2]"),
    ({"train_command": "python train.py"}, "command"),
    ({"train_command": []}, "command"),
    ({"transform": "{{ params.transform }}"}, "transform"),
    ({"evaluate": "pkg/eval.py"}, "evaluate"),
    ({"goal": "lower"}, "goal"),
    ({"min_improvement": -1}, "min_improvement"),
    ({"relative_tolerance": 5}, "relative_tolerance"),
    ({"min_improvement": 0.1, "tolerance": 0.01}, "min_improvement"),
    ({"params": {"nodes": 3}}, "params"),
    ({"params": {"my-param": 3}}, "params"),
    ({"model_name": "../model.pt"}, "model_name"),
    ({"command": ["x"]}, "operator_args"),
    ({"run_dir": "/tmp/x"}, "operator_args"),
    ({"pack": {"field": "ids", "block_size": 0}}, "pack"),
    ({"pack": {"block_size": 8}}, "pack"),
])
def test_a_mistake_fails_the_dag_at_parse_time_naming_the_argument(overrides, field):
    with pytest.raises(SpecError) as info:
        build(**overrides)
    assert info.value.field == field


def test_pack_reaches_every_mapped_preprocess_task_checked():
    dag = build("lm", pack={"field": "input_ids", "block_size": 64, "separator": 1})
    assert dag.get_task("preprocess").partial_kwargs["pack"] == {"field": "input_ids", "block_size": 64, "separator": 1}
    assert build("plain").get_task("preprocess").partial_kwargs["pack"] is None


def test_publish_is_atomic_and_the_warm_start_is_the_newest_model_before_the_date(tmp_path):
    root = str(tmp_path / "models" / "p")
    trained = tmp_path / "run" / "model"
    trained.mkdir(parents=True)
    (trained / "weights.bin").write_bytes(b"w1")
    publish_model(str(trained), {"evaluation": {"rmse": 0.5}}, root, "v1", "2026-01-01", model_name="model")
    (trained / "weights.bin").write_bytes(b"w2")
    publish_model(str(trained), {"evaluation": {"rmse": 0.4}}, root, "v1", "2026-01-03", model_name="model")
    assert previous_model(root, "v1", "2026-01-01", "model") == ""  # strictly before: a rerun starts as before
    assert previous_model(root, "v1", "2026-01-02", "model") == os.path.join(root, "v1", "2026-01-01", "model")
    path, record = previous_published(root, "v1", "2026-02-01", "model")
    assert path.endswith("2026-01-03/model") and record == {"evaluation": {"rmse": 0.4}}
    assert (tmp_path / "models/p/v1/2026-01-03/model/weights.bin").read_bytes() == b"w2"
    # A rerun swaps the whole directory; nothing hidden is left.
    publish_model(str(trained), {"evaluation": {"rmse": 0.3}}, root, "v1", "2026-01-03", model_name="model")
    assert sorted(os.listdir(os.path.join(root, "v1"))) == ["2026-01-01", "2026-01-03"]
    # A partition without metrics.json is not published (a crash between the two renames cannot make one).
    os.makedirs(os.path.join(root, "v1", "2026-01-05", "model"))
    assert previous_model(root, "v1", "2026-02-01", "model").endswith("2026-01-03/model")


def test_publish_refuses_a_symbolic_link_and_a_missing_model(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("not a model")
    link = tmp_path / "model.pt"
    link.symlink_to(secret)
    with pytest.raises(PublishError, match="symbolic link"):
        publish_model(str(link), {}, str(tmp_path / "m"), "v1", "2026-01-01")
    with pytest.raises(PublishError, match="did not write its model"):
        publish_model(str(tmp_path / "none.pt"), {}, str(tmp_path / "m"), "v1", "2026-01-01")
    assert os.listdir(tmp_path / "m" / "v1") == []  # the temporary directory was removed


def test_a_gate_with_only_a_tolerance_is_decided_against_the_published_model(tmp_path):
    from dtrain.pipeline.gate import Gate
    from dtrain.pipeline.registry import DirectoryRegistry, Pipeline
    from dtrain.pipeline.steps import decide_with

    registry = DirectoryRegistry(str(tmp_path / "models")).for_pipeline(Pipeline(dag_id="p", shared_fs="",
                                                                                  model_name="model.pt"))

    def decide(gate, metrics, _root, version, partition, _name):
        return decide_with(gate, metrics, registry, version, partition)

    root = str(tmp_path / "models" / "p")
    trained = tmp_path / "model.pt"
    trained.write_bytes(b"w")
    publish_model(str(trained), {"evaluation": {"f1": 0.988}}, root, "v1", "2026-01-01")
    gate = Gate(metric="f1", goal="maximize", relative_tolerance=0.005)
    noisy = decide(gate, {"f1": 0.9849}, root, "v1", "2026-01-02", "model.pt")
    assert noisy.publish and noisy.baseline_model == os.path.join(root, "v1", "2026-01-01", "model.pt")
    assert "vs published 0.988" in noisy.summary
    assert not decide(gate, {"f1": 0.95}, root, "v1", "2026-01-02", "model.pt").publish
