"""The text example's MLflow pipeline (examples/text/dags/text_retraining.py: text_retraining_mlflow)
declares its tokenizer an artifact of the model: what the example's train script leaves in the run
directory (the model and, beside it, the tokenizer it was trained with) goes through the DAG's own
registry against a real `mlflow server` (tests/mlflow/conftest.py), and the registered version holds the
tokenizer as ``artifacts/tokenizer``, byte for byte the committed one, beside the model and its code."""

from __future__ import annotations

import importlib.util
import os

from dtrain.pipeline.registry import RunRef
from dtrain.tracking import run_key, start_or_resume
from tests.pipeline.conftest import TEXT


def text_dags():
    """The example's DAG file as a module, its DAGs not registered as this test's (Airflow registers
    every DAG built while a DAG file is imported)."""
    from airflow.sdk.definitions._internal.contextmanager import DagContext

    spec = importlib.util.spec_from_file_location("text_retraining_example",
                                                  os.path.join(TEXT, "dags", "text_retraining.py"))
    module = importlib.util.module_from_spec(spec)
    importing, DagContext.current_autoregister_module_name = DagContext.current_autoregister_module_name, None
    try:
        spec.loader.exec_module(module)
    finally:
        DagContext.current_autoregister_module_name = importing
    return module


def test_a_text_model_version_holds_the_tokenizer_it_was_trained_with(mlflow_server, client, tmp_path, monkeypatch):
    import mlflow.artifacts
    import mlflow.pytorch
    import torch

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
