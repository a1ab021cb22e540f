"""retrain_pipeline's UI params: what the trigger refuses (the Params' schemas, on the path Airflow's
API server validates a new run with), and what the run's first task, check_params, refuses before
any data is read, preprocessed or staged. The REST half (a real API server) is in test_retrain_e2e."""

from __future__ import annotations

import copy
import datetime as dt
import importlib.util
import json
import os
import re
import shutil
import subprocess
import types

import pytest
from jsonschema import Draft202012Validator, FormatChecker, validate
from jsonschema.exceptions import ValidationError

from dtrain.errors import SpecError
from dtrain.pipeline import params as P
from tests.conftest import REPO

NAN, INF = float("nan"), float("inf")
VERSIONS_OK = ["v1", "2026.01_b-3", "A" * 64]
VERSIONS_BAD = ["v1\n", "v1\r\n", "v1\n\n", "\nv1", "v1\nx", "A" * 65, "../etc", "-v1", ".v1", "", "v1 ", "v1/x"]


@pytest.fixture(scope="module")
def retrain():
    """dags/retrain_pipeline.py, imported as a module: its DAG (built by the pipeline factory), with
    the factory's PARAMS, BACKEND_OPTIONS and deepspeed_config macro picked out of it."""
    spec = importlib.util.spec_from_file_location("retrain_pipeline_params_test",
                                                  os.path.join(REPO, "dags", "retrain_pipeline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.PARAMS = {name: module.dag.params.get_param(name) for name in module.dag.params}
    module.BACKEND_OPTIONS = module.dag.get_task("train").backend_options
    module.deepspeed_config = module.dag.user_defined_macros["dtrain_deepspeed_config"]
    return module


def schemas(module) -> dict:
    return {name: param.schema for name, param in module.PARAMS.items()}


def server_params(dag):
    """The params as the API server holds them (from the serialized DAG). Its trigger route calls
    create_dagrun, which runs ``params.deep_merge(conf).validate()``: a ParamValidationError there
    is the REST API's 400, raised before the run is written."""
    from airflow.serialization.serialized_objects import DagSerialization

    return DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag)).params


def trigger_error(dag, conf) -> str | None:
    """The message the trigger would refuse ``conf`` with, or None if it creates the run."""
    from airflow.exceptions import ParamValidationError

    try:
        server_params(dag).deep_merge(conf).validate()
    except ParamValidationError as e:
        return str(e)
    return None


def render(task, conf: dict, xcoms: dict | None = None):
    """A copy of ``task`` with its template fields rendered as a run with ``conf`` renders them
    (``xcoms``: task id -> return value, replacing the usual ones)."""
    params = copy.deepcopy(task.dag.params)
    params.update(conf)  # validates each value, as the SDK does for context["params"]
    checked = P.check_params(server_params(task.dag).deep_merge(conf).validate(),
                             {name: task.dag.params.get_param(name).schema for name in task.dag.params},
                             cpus=64, gpus=0)  # what the check_params task returns

    class TI:
        def xcom_pull(self, task_ids=None, **_):
            return {"stage": {"manifest_path": "/shared/d/manifest.json", "destination": "/shared/d"},
                    "preflight": {"nccl_env": {}}, "check_params": checked,
                    "train": {"run_dir": "/shared/runs/x", "metrics": {}}, **(xcoms or {})}[task_ids]

    dag_run = types.SimpleNamespace(logical_date=dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), clear_number=0)
    rendered = copy.copy(task)
    rendered.render_template_fields({"params": params, "ti": TI(), "dag_run": dag_run, "dag": task.dag})
    return rendered


# -- finding 1: integral floats -------------------------------------------------------------------

def test_integral_float_params_arrive_as_integers(retrain):
    conf = {"nodes": 2.0, "procs_per_node": 2.0, "epochs": 1.0}
    assert trigger_error(retrain.dag, conf) is None  # JSON-schema integers: the trigger accepts 2.0
    stage, preflight, train = (render(retrain.dag.get_task(t), conf) for t in ("stage", "preflight", "train"))
    assert stage.nodes == "2"
    assert (preflight.nodes, preflight.procs_per_node) == ("2", "2")
    assert (train.nodes, train.procs_per_node) == ("2", "2")
    assert train.command[train.command.index("--epochs") + 1] == "1"  # train_digits parses it with int()
    values = P.check_params(server_params(retrain.dag).deep_merge(conf).validate(), schemas(retrain), cpus=2, gpus=0)
    assert (values["nodes"], values["procs_per_node"], values["epochs"]) == (2, 2, 1)
    assert all(type(values[k]) is int for k in ("nodes", "procs_per_node", "epochs"))


# -- finding 2: NaN and the infinities ------------------------------------------------------------

def test_finite_keyword_refuses_nan_and_minus_infinity_in_airflows_jsonschema():
    # Every comparison keyword lets NaN through: what the review found.
    assert Draft202012Validator({"type": "number", "exclusiveMinimum": 0, "maximum": 10}).is_valid(NAN)
    schema = {"type": "number", **P.FINITE}
    for bad in (NAN, -INF):
        with pytest.raises(ValidationError):
            validate(bad, schema, format_checker=FormatChecker())  # the call Param.resolve makes
    for fine in (0, -0.0, 5e-324, 0.05, 1, 10, -1e307, 1e308, INF):  # +Infinity is left to "maximum"
        validate(fine, schema, format_checker=FormatChecker())


def test_number_params_refuse_nan_and_infinities_when_triggered(retrain):
    numbers = {n: p for n, p in retrain.PARAMS.items() if p.schema.get("type") == "number"}
    assert set(numbers) == {"base_lr"}
    for name, param in numbers.items():
        for bad in (NAN, INF, -INF):
            assert f"Invalid input for param {name}" in (trigger_error(retrain.dag, {name: bad}) or ""), (name, bad)
            with pytest.raises(Exception, match="should not be valid|greater than|less than"):
                copy.copy(param).resolve(bad)  # the SDK's Param (dag.test, the trigger form's defaults)
            with pytest.raises(P.ParamError, match=f"param {name}="):
                P.check_params({name: bad}, {name: param.schema})
        assert trigger_error(retrain.dag, {name: param.value}) is None
        assert trigger_error(retrain.dag, {name: 0.5}) is None
        assert param.schema["not"] == P.FINITE["not"] and abs(param.schema["maximum"]) < 1e308  # +inf: maximum


# -- finding 3: a trailing newline ----------------------------------------------------------------

def test_dataset_version_refuses_a_trailing_newline_when_triggered(retrain):
    schema = retrain.PARAMS["dataset_version"].schema
    assert re.search("^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", "v1\n")  # the old pattern: `$` before a final "\n"
    for version in VERSIONS_OK:
        validate(version, schema, format_checker=FormatChecker())
        assert trigger_error(retrain.dag, {"dataset_version": version}) is None
        assert P.check_params({"dataset_version": version}, {"dataset_version": schema}) == {"dataset_version": version}
    for version in VERSIONS_BAD:
        with pytest.raises(ValidationError):
            validate(version, schema, format_checker=FormatChecker())
        assert "Invalid input for param dataset_version" in (trigger_error(retrain.dag, {"dataset_version": version})
                                                             or ""), version
        with pytest.raises(P.ParamError, match="param dataset_version="):
            P.check_params({"dataset_version": version}, {"dataset_version": schema})
    assert schema["pattern"] == P.DATASET_VERSION_PATTERN  # the one the JavaScript test compiles


def test_dataset_version_pattern_means_the_same_in_javascript():
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on PATH to compile the pattern as the UI's JavaScript does")
    script = r"""
const [pattern, values] = JSON.parse(require("fs").readFileSync(0, "utf8"));
const out = {};
for (const flags of ["", "u", "v"]) {  // the UI's JSON editor: "u", else none; an HTML pattern attribute: "v"
  const re = new RegExp(pattern, flags);
  out[flags] = values.map(v => re.test(v));
}
console.log(JSON.stringify(out));
"""
    values = VERSIONS_OK + VERSIONS_BAD
    proc = subprocess.run([node, "-e", script], input=json.dumps([P.DATASET_VERSION_PATTERN, values]),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    expected = [True] * len(VERSIONS_OK) + [False] * len(VERSIONS_BAD)
    assert [bool(re.search(P.DATASET_VERSION_PATTERN, v)) for v in values] == expected  # jsonschema's re.search
    assert json.loads(proc.stdout) == {"": expected, "u": expected, "v": expected}


# -- finding 4: check_params, the run's first task -------------------------------------------------

def test_too_many_local_ranks_fail_in_check_params_before_any_data_is_touched(retrain, airflow_db, monkeypatch):
    import airflow.sdk.execution_time.supervisor as supervisor

    import dtrain.launch.backends.placement

    monkeypatch.delenv(P.MAX_RANKS_ENV, raising=False)
    limit, _ = P.local_rank_limit()
    if limit >= 64 * 16:  # a worker that may run 1,024 ranks: judge as the 2-core CI worker would
        monkeypatch.setattr(P, "usable_cpus", lambda: 2)
        monkeypatch.setattr(dtrain.launch.backends.placement, "visible_gpu_count", lambda: 0)
        limit = 2 * P.OVERSUBSCRIPTION
    ran: dict[str, BaseException | None] = {}
    real = supervisor.run_task_in_process

    def record(ti, task):
        result = real(ti=ti, task=task)
        ran[ti.task_id] = result.error
        return result

    monkeypatch.setattr(supervisor, "run_task_in_process", record)  # what dag.test() runs each task with
    run = retrain.dag.test(run_conf={"nodes": 64, "procs_per_node": 16, "backend": "local"})
    states = {ti.task_id: ti.state for ti in run.get_task_instances()}
    assert run.state == "failed"
    assert states["check_params"] == "failed"
    for task_id in ("list_raw_inputs", "preprocess", "finalize_dataset", "stage", "preflight", "train"):
        assert states[task_id] == "upstream_failed", states
    assert list(ran) == ["check_params"]  # nothing else started
    message = str(ran["check_params"])
    assert message.startswith("param nodes=64 x procs_per_node=16 = 1024 ranks is too many for backend=local"), message
    assert f"at most {limit} ranks here" in message and P.MAX_RANKS_ENV in message, message


def test_check_params_converts_and_refuses_what_no_schema_can(retrain):
    s = schemas(retrain)
    defaults = {name: param.value for name, param in retrain.PARAMS.items()}
    assert P.check_params(defaults, s, cpus=2, gpus=0) == defaults  # the demo's 2 x 2 fits a 2-core worker
    assert P.check_params({**defaults, "nodes": 4.0, "epochs": "3.0"}, s, cpus=2, gpus=0)["nodes"] == 4
    refused = {
        "nodes": {**defaults, "nodes": 2.5},
        "epochs": {**defaults, "epochs": "many"},
        "base_lr": {**defaults, "base_lr": "nan"},
        "distribution": {**defaults, "distribution": "horovod"},
        "nodez": {**defaults, "nodez": 4},  # a typo Airflow would merge into params and ignore
        "nodes x procs_per_node": {**defaults, "nodes": 3, "procs_per_node": 3},  # 9 > 8
    }
    for field, params in refused.items():
        with pytest.raises(P.ParamError) as info:
            P.check_params(params, s, cpus=2, gpus=0)
        assert info.value.field == field and str(info.value).startswith("param "), info.value
    # Only backend=local runs the ranks on this worker.
    big = {**defaults, "nodes": 64, "procs_per_node": 16}
    assert P.check_params({**big, "backend": "slurm"}, s, cpus=2, gpus=0)["nodes"] == 64
    # GPUs count like cores; DTRAIN_LOCAL_MAX_RANKS overrides, and a bad one is named.
    assert P.check_params({**defaults, "nodes": 8, "procs_per_node": 4}, s, cpus=2, gpus=8)["nodes"] == 8
    assert P.check_params(big, s, environ={P.MAX_RANKS_ENV: "1024"}, cpus=2, gpus=0)["nodes"] == 64
    with pytest.raises(P.ParamError, match="at most 16 ranks here"):
        P.check_params({**defaults, "nodes": 4, "procs_per_node": 8}, s, environ={P.MAX_RANKS_ENV: "16"})
    with pytest.raises(SpecError, match=P.MAX_RANKS_ENV):
        P.check_params(defaults, s, environ={P.MAX_RANKS_ENV: "lots"})


def test_local_rank_limit_follows_this_worker(monkeypatch):
    from dtrain.launch.backends.placement import visible_gpu_count

    monkeypatch.delenv(P.MAX_RANKS_ENV, raising=False)
    limit, why = P.local_rank_limit()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert limit == max(cpus, visible_gpu_count()) * P.OVERSUBSCRIPTION
    assert f"{cpus} CPU core(s)" in why


def test_check_launch_refuses_what_train_would_refuse_later(retrain, monkeypatch):
    import dtrain.launch.backends.placement

    values = {name: param.value for name, param in retrain.PARAMS.items()}
    monkeypatch.setattr(dtrain.launch.backends.placement, "visible_gpu_count", lambda: 0)
    assert P.check_launch(values, retrain.BACKEND_OPTIONS).world_size == 4
    deepspeed = {**values, "distribution": "deepspeed"}
    assert P.check_launch(deepspeed, retrain.BACKEND_OPTIONS, retrain.deepspeed_config(deepspeed)).world_size == 4
    monkeypatch.setattr(dtrain.launch.backends.placement, "visible_gpu_count", lambda: 1)  # a worker with one GPU
    with pytest.raises(SpecError, match=r"procs_per_node=2 is invalid: at most the 1 GPU"):
        P.check_launch(values, retrain.BACKEND_OPTIONS)


def test_check_params_is_the_first_task(retrain):
    dag = retrain.dag
    assert [t.task_id for t in dag.roots] == ["check_params"]
    assert dag.get_task("check_params").retries == 0
    downstream = dag.get_task("check_params").get_flat_relative_ids(upstream=False)
    assert {"list_raw_inputs", "preprocess", "finalize_dataset", "stage", "preflight", "train", "evaluate",
            "publish"} <= downstream
