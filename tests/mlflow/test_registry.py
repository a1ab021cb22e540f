"""MlflowRegistry and dtrain.mlflow.tracking against a real `mlflow server` (tests/mlflow/conftest.py), without
Airflow: the run a train task creates and resumes, the metrics it logs from the ranks' records, and the
registry's rules (champion moves forward only, a failure between register and alias changes nothing,
the gate's baseline and the warm start are the champion's), asserted through MLflow's client API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from dtrain.pipeline.registry import Pipeline, RunRef
from dtrain.mlflow.registry import MlflowRegistry
from dtrain.mlflow.tracking import find_run, run_key, start_or_resume
from tests.mlflow.model import save


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def registry_for(mlflow_server, tmp_path, **kwargs) -> MlflowRegistry:
    dag_id = unique("dag")
    registry = MlflowRegistry(unique("model"), conn_id=None, tracking_uri=mlflow_server.uri, **kwargs)
    return registry.for_pipeline(Pipeline(dag_id, shared_fs=str(tmp_path / "fsx"), model_name="model.pt"))


def trained(registry, client, tmp_path, partition: str, seed: int, rmse: float) -> RunRef:
    """What the pipeline does before publish: the train task's run, then evaluate's record_evaluation."""
    run = RunRef(run_id=f"scheduled__{partition}", clear_number=0, version="v1", partition=partition)
    key = run_key(registry.pipeline.dag_id, run.run_id, 0)
    start_or_resume(client, registry.experiment_name, key, {"dtrain.partition": partition})
    model = tmp_path / partition / "model.pt"  # {output}: <run_dir>/<model_name>
    model.parent.mkdir()
    save(str(model), seed)
    registry.record_evaluation(run, {"metrics": {"rmse": rmse, "samples": 10}, "model_path": str(model)})
    return run


def aliases(client, registry) -> dict[str, str]:
    return {alias: str(version) for alias, version in client.get_registered_model(registry.model_name).aliases.items()}


def test_a_train_task_run_is_found_again_on_retry_and_a_cleared_run_gets_its_own(client):
    experiment = unique("exp")
    key = run_key("dag", "manual__1", 0)
    first, resumed = start_or_resume(client, experiment, key, {"dtrain.task_try": "1"})
    assert not resumed
    client.set_terminated(first.info.run_id, "FAILED")
    again, resumed = start_or_resume(client, experiment, key, {"dtrain.task_try": "2"})
    assert resumed and again.info.run_id == first.info.run_id
    stored = client.get_run(first.info.run_id)
    assert stored.info.status == "RUNNING" and stored.data.tags["dtrain.task_try"] == "2"
    cleared, resumed = start_or_resume(client, experiment, run_key("dag", "manual__1", 1), {})
    assert not resumed and cleared.info.run_id != first.info.run_id
    # A run id with quotes and spaces still finds its run: the key is hex, whatever the id holds.
    odd = run_key("dag", "manual__it's a 'run'", 0)
    made, _ = start_or_resume(client, experiment, odd, {})
    assert find_run(client, made.info.experiment_id, odd).info.run_id == made.info.run_id


def test_params_are_logged_once_and_a_retry_does_not_fail_on_them(client):
    from dtrain.mlflow.tracking import log_params

    run, _ = start_or_resume(client, unique("exp"), run_key("dag", "r", 0), {})
    assert log_params(client, run, {"nodes": 2, "epochs": 4, "nothing": None}) == {"nodes": "2", "epochs": "4"}
    again = client.get_run(run.info.run_id)
    assert log_params(client, again, {"nodes": 2, "epochs": 4}) == {}
    assert client.get_run(run.info.run_id).data.params == {"nodes": "2", "epochs": "4"}


def test_the_ranks_records_become_rank_0s_step_metrics_and_the_stall_verdicts(client, tmp_path):
    from dtrain.mlflow.operator import TrackedTrainingOperator
    from dtrain.training.metrics import MetricsWriter

    run_dir = tmp_path / "run"
    for rank, loss0 in ((0, 2.0), (1, 9.0)):
        writer = MetricsWriter(rank, str(run_dir / "metrics"))
        for step in range(1, 4):
            writer.log(step=step, loss=loss0 / step, samples=32, step_time_s=0.5, data_wait_s=0.1)
        if rank == 0:  # a resumed job logs step 3 again: the newest record wins
            writer.log(step=3, loss=0.25, samples=32, step_time_s=0.5, data_wait_s=0.2)
        writer.close()
    run, _ = start_or_resume(client, unique("exp"), run_key("dag", "r", 0), {})
    stall = {"rules": {"CPUBottleneck": {"triggered": True, "max_data_wait_fraction": 0.4},
                       "LoadBalancing": {"triggered": False, "slowest_to_median": 1.05}}}
    TrackedTrainingOperator._log_job(client, run.info.run_id, {
        "run_dir": str(run_dir), "stall": stall, "metrics": {"train_rmse": 0.3, "global_batch": 64, "lr": 0.02}})
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert loss == [(1, 2.0), (2, 1.0), (3, 0.25)]
    wait = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "data_wait_fraction"))
    assert wait == [(1, 0.2), (2, 0.2), (3, 0.4)]
    data = client.get_run(run.info.run_id).data
    assert data.metrics["samples_per_s"] == 64.0 and data.metrics["train.train_rmse"] == 0.3
    assert data.metrics["stall.CPUBottleneck"] == 1.0 and data.metrics["stall.LoadBalancing"] == 0.0
    assert data.metrics["stall.max_data_wait_fraction"] == 0.4
    assert data.params["global_batch"] == "64" and data.params["scaled_lr"] == "0.02"


def test_champion_moves_forward_only_and_the_gate_and_warm_start_read_it(mlflow_server, client, tmp_path):
    registry = registry_for(mlflow_server, tmp_path)
    assert registry.baseline("v1", "2026-03-01") is None and registry.warm_start("v1", "2026-03-01") == ""
    first = trained(registry, client, tmp_path, "2026-03-01", seed=1, rmse=0.5)
    out = registry.publish(first, "", {"evaluation": {"rmse": 0.5}}).record
    assert (out["version"], out["alias"], out["champion"]) == ("1", "champion", True)
    second = trained(registry, client, tmp_path, "2026-03-02", seed=2, rmse=0.4)
    assert registry.publish(second, "", {}).record["version"] == "2"
    assert aliases(client, registry) == {"champion": "2"}
    baseline = registry.baseline("v1", "2026-03-03")
    assert baseline.model == f"models:/{registry.model_name}/2" and baseline.metrics == {"rmse": 0.4, "samples": 10}

    # A backfill of an older date: registered, as challenger; champion keeps the newer date's version.
    backfill = trained(registry, client, tmp_path, "2026-02-15", seed=3, rmse=0.1)
    out = registry.publish(backfill, "", {})
    assert (out.record["version"], out.record["alias"], out.record["champion"]) == ("3", "challenger", False)
    assert aliases(client, registry) == {"champion": "2", "challenger": "3"}
    assert "champion stays at version 2 (2026-03-02)" in out.summary

    # The warm start is the champion's file as trained, downloaded once onto the shared filesystem.
    path = registry.warm_start("v1", "2026-03-04")
    assert path == str(tmp_path / "fsx" / "registry" / registry.pipeline.dag_id / registry.model_name / "2" / "model.pt")
    assert open(path, "rb").read() == (tmp_path / "2026-03-02" / "model.pt").read_bytes()
    assert registry.warm_start("v1", "2026-03-05") == path
    version = client.get_model_version(registry.model_name, "2")
    assert version.source == f"runs:/{version.run_id}/trained/model.pt"
    assert version.tags["dtrain.partition"] == "2026-03-02"
    recorded = json.loads(open(client.download_artifacts(version.run_id, "metrics.json", str(tmp_path)), "rb").read())
    assert recorded == {}  # publish's record replaced evaluate's metrics.json: the published version's verdicts


def test_a_failure_between_register_and_alias_leaves_champion_and_a_retry_registers_nothing_twice(
        mlflow_server, client, tmp_path, monkeypatch):
    registry = registry_for(mlflow_server, tmp_path)
    registry.publish(trained(registry, client, tmp_path, "2026-03-01", seed=1, rmse=0.5), "", {})
    run = trained(registry, client, tmp_path, "2026-03-02", seed=2, rmse=0.4)
    from mlflow import MlflowClient

    original = MlflowClient.set_registered_model_alias

    def server_gone(self, *args, **kwargs):  # fault injection: the call after registering fails
        raise ConnectionError("tracking server went away")

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", server_gone)
    with pytest.raises(ConnectionError):
        registry.publish(run, "", {})
    assert aliases(client, registry) == {"champion": "1"}
    assert len(client.search_model_versions(f"name='{registry.model_name}'")) == 2  # registered, not champion
    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", original)
    out = registry.publish(run, "", {}).record  # the task's retry
    assert out["version"] == "2" and aliases(client, registry) == {"champion": "2"}
    assert len(client.search_model_versions(f"name='{registry.model_name}'")) == 2


def test_a_consumer_loads_the_champion_in_a_fresh_process_and_predicts(mlflow_server, client, tmp_path, own_tmpdir):
    import torch

    from tests.mlflow.model import load

    registry = registry_for(mlflow_server, tmp_path, load_model="tests.mlflow.model:load")
    run = trained(registry, client, tmp_path, "2026-03-01", seed=7, rmse=0.5)
    assert registry.publish(run, "", {}).record["model_uri"] == f"models:/{registry.model_name}/1"
    x = [[0.5, -1.0, 2.0, 0.25], [1.0, 1.0, 1.0, 1.0]]
    with torch.no_grad():
        expected = load(str(tmp_path / "2026-03-01" / "model.pt"))(torch.tensor(x)).squeeze(1).tolist()
    consumer = ("import json, sys, torch, mlflow.pytorch\n"
                f"model = mlflow.pytorch.load_model('models:/{registry.model_name}@champion')\n"
                "with torch.no_grad():\n"
                "    print(json.dumps(model(torch.tensor(json.loads(sys.argv[1]))).squeeze(1).tolist()))\n")
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server.uri, "PYTHONPATH": ""}  # no dtrain, no tests package
    proc = subprocess.run([sys.executable, "-c", consumer, json.dumps(x)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == pytest.approx(expected, abs=1e-6)


def test_a_reprocessed_old_date_starts_from_and_is_gated_against_the_model_published_before_it(
        mlflow_server, client, tmp_path):
    """Reprocessing 03-01 after 03-04 is champion: nothing was published before 03-01, so no warm start
    and nothing to beat; a run of 03-02 starts from 03-01's model, not from the champion."""
    registry = registry_for(mlflow_server, tmp_path)
    registry.publish(trained(registry, client, tmp_path, "2026-03-01", seed=1, rmse=0.5), "", {})
    registry.publish(trained(registry, client, tmp_path, "2026-03-04", seed=4, rmse=0.2), "", {})
    assert aliases(client, registry) == {"champion": "2"}

    assert registry.warm_start("v1", "2026-03-01") == "" and registry.baseline("v1", "2026-03-01") is None
    before_march_2 = registry.warm_start("v1", "2026-03-02")
    assert before_march_2.endswith(f"/{registry.model_name}/1/model.pt")
    assert open(before_march_2, "rb").read() == (tmp_path / "2026-03-01" / "model.pt").read_bytes()
    assert registry.baseline("v1", "2026-03-02").model == f"models:/{registry.model_name}/1"
    assert registry.baseline("v1", "2026-03-02").metrics["rmse"] == 0.5
    assert registry.baseline("v1", "2026-03-05").model == f"models:/{registry.model_name}/2"
    assert registry.baseline("v2", "2026-03-05") is None  # another dataset version starts afresh

    # The reprocessed 03-01 is published: champion stays with 03-04, and 03-02 now follows the new 03-01.
    rerun = RunRef(run_id="scheduled__2026-03-01", clear_number=1, version="v1", partition="2026-03-01")
    start_or_resume(client, registry.experiment_name, run_key(registry.pipeline.dag_id, rerun.run_id, 1), {})
    model = tmp_path / "rerun" / "model.pt"
    model.parent.mkdir()
    save(str(model), 11)
    registry.record_evaluation(rerun, {"metrics": {"rmse": 0.45}, "model_path": str(model)})
    out = registry.publish(rerun, "", {}).record
    assert (out["version"], out["alias"]) == ("3", "challenger") and aliases(client, registry)["champion"] == "2"
    assert registry.baseline("v1", "2026-03-02").model == f"models:/{registry.model_name}/3"
    assert open(registry.warm_start("v1", "2026-03-02"), "rb").read() == model.read_bytes()


#: a team's own package, outside the repository: a GRU language model of its own class
OWN_MODEL = '''
import torch


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=16, width=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.rnn = torch.nn.GRU(width, width, batch_first=True)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(self.rnn(self.embed(ids))[0])


def load(path):
    model = TinyLM()
    model.load_state_dict(torch.load(path, weights_only=True))
    return model
'''

CONSUMER = '''
import importlib.util, json, os, sys
import mlflow.artifacts, mlflow.pytorch, torch
assert importlib.util.find_spec("acme_lm") is None and importlib.util.find_spec("dtrain") is None
uri = sys.argv[1]
model = mlflow.pytorch.load_model(uri)
with torch.no_grad():
    logits = model(torch.tensor(json.loads(sys.argv[2])))
folder = mlflow.artifacts.download_artifacts(uri, dst_path=sys.argv[3])
with open(os.path.join(folder, "artifacts", "tokenizer"), encoding="utf-8") as fh:
    print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__,
                      "logits": logits.flatten().tolist(), "tokenizer": json.load(fh)}))
'''


@pytest.fixture
def venv_dir(tmp_path):
    """Where the consumer's venv goes; removed after the test (it holds torch and MLflow)."""
    import shutil

    path = tmp_path / "consumer-venv"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_an_own_model_class_loads_in_a_fresh_venv_with_only_the_versions_requirements_and_its_tokenizer(
        mlflow_server, client, tmp_path, monkeypatch, venv_dir, own_tmpdir):
    import torch

    from tests.mlflow.fresh_venv import fresh_venv

    package = tmp_path / "team" / "acme_lm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(OWN_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path / "team"))
    from acme_lm.model import TinyLM, load

    registry = registry_for(mlflow_server, tmp_path, load_model="acme_lm.model:load",
                            artifacts={"tokenizer": "tokenizer.json"})
    run = RunRef(run_id="scheduled__2026-03-01", clear_number=0, version="v1", partition="2026-03-01")
    start_or_resume(client, registry.experiment_name, run_key(registry.pipeline.dag_id, run.run_id, 0), {})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torch.manual_seed(3)
    torch.save(TinyLM().state_dict(), run_dir / "model.pt")
    tokenizer = {"model": {"type": "BPE", "vocab": {"<eos>": 1, "a": 2}}}
    (run_dir / "tokenizer.json").write_text(json.dumps(tokenizer))  # written by the training command
    registry.record_evaluation(run, {"metrics": {"perplexity": 3.9}, "model_path": str(run_dir / "model.pt")})
    registry.publish(run, "", {})

    ids = [[1, 2, 3, 4], [5, 6, 7, 8]]
    with torch.no_grad():
        expected = load(str(run_dir / "model.pt"))(torch.tensor(ids)).flatten().tolist()
    import mlflow.pyfunc

    uri = f"models:/{registry.model_name}@champion"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    requirements = mlflow.pyfunc.get_model_dependencies(uri)
    python = fresh_venv(str(venv_dir), requirements)
    consumer = tmp_path / "consumer"
    consumer.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(consumer), "MLFLOW_TRACKING_URI": mlflow_server.uri,
           "TMPDIR": os.environ["TMPDIR"]}
    proc = subprocess.run([python, "-c", CONSUMER, uri, json.dumps(ids), str(consumer / "download")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(consumer))
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["class"] == "acme_lm.model.TinyLM" and loaded["tokenizer"] == tokenizer
    assert loaded["logits"] == pytest.approx(expected, abs=1e-6)


# -- the text example's MLflow pipeline -------------------------------------------------------------
# examples/text/dags/text_retraining.py (text_retraining_mlflow) declares its tokenizer an artifact of
# the logged model: what the example's train script leaves in the run directory (the model and, beside
# it, the tokenizer it was trained with) goes through the DAG's own registry, and the version holds the
# tokenizer as artifacts/tokenizer, byte for byte the committed one, beside the model and its code.


def text_dags():
    """The text example's DAG file as a module, its DAGs not registered as this test's (Airflow registers
    every DAG built while a DAG file is imported)."""
    import importlib.util

    from airflow.sdk.definitions._internal.contextmanager import DagContext

    from tests.pipeline.conftest import TEXT

    spec = importlib.util.spec_from_file_location("text_retraining_example",
                                                  os.path.join(TEXT, "dags", "text_retraining.py"))
    module = importlib.util.module_from_spec(spec)
    importing, DagContext.current_autoregister_module_name = DagContext.current_autoregister_module_name, None
    try:
        spec.loader.exec_module(module)
    finally:
        DagContext.current_autoregister_module_name = importing
    return module


def test_a_text_model_version_holds_the_tokenizer_it_was_trained_with(mlflow_server, client, tmp_path, monkeypatch,
                                                                      own_tmpdir):
    import mlflow.artifacts
    import mlflow.pytorch
    import torch

    from tests.pipeline.conftest import TEXT

    monkeypatch.syspath_prepend(TEXT)  # as the team's PYTHONPATH on its workers
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_DEFAULT", mlflow_server.uri)  # the DAG's mlflow_default connection
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    from text_pipeline import model as lm
    from text_pipeline import tokenizer
    from text_pipeline.train import save_with_tokenizer

    registry = text_dags().mlflow_dag.get_task("train").registry
    run = RunRef(run_id="manual__2026-03-01", clear_number=0, version="v1", partition="2026-03-01")
    start_or_resume(client, registry.experiment_name, run_key(registry.pipeline.dag_id, run.run_id, 0), {})
    output = tmp_path / "run-0" / registry.pipeline.model_name  # the train command's {output}
    torch.manual_seed(0)
    model = lm.CausalLM(tokenizer.VOCAB_SIZE, 64).eval()
    save_with_tokenizer(model, str(output))  # what rank 0 of text_pipeline.train does at the end
    registry.record_evaluation(run, {"metrics": {"perplexity": 9.0}, "model_path": str(output)})
    published = registry.publish(run, str(output), {})

    uri = published.record["model_uri"]
    folder = mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "download"))
    with open(os.path.join(folder, "artifacts", "tokenizer"), "rb") as logged, open(tokenizer.PATH, "rb") as committed:
        assert logged.read() == committed.read()
    assert os.path.isfile(os.path.join(folder, "code", "text_pipeline", "model.py"))  # the class's code travels too
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(mlflow.pytorch.load_model(uri).eval()(ids), model(ids))
