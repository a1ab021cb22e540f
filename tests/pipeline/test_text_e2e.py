"""The text example (examples/text: JSON-lines documents -> tokenized, packed shards -> a small causal
transformer trained 1x2 with DDP -> held-out perplexity, minimized -> gate -> publish) end to end with
real Airflow: `airflow dags test` against moto's S3, as its team would run it first."""

from __future__ import annotations

import json
import os
import subprocess
import time

from .conftest import BIN, TEXT, TEXT_DATE, bundle, example_module

DAG = "text_retraining"
DAG_FILE = os.path.join(TEXT, "dags", "text_retraining.py")


def untrained_perplexity(tmp_path, block_size: int) -> float:
    """The bar a trained model must clear by far: the same model, untrained, on the same held-out text."""
    import torch

    model = example_module(TEXT, "text_pipeline.model")
    tokenizer = example_module(TEXT, "text_pipeline.tokenizer")
    data = example_module(TEXT, "text_pipeline.data")
    evaluate = example_module(TEXT, "text_pipeline.evaluate")
    torch.manual_seed(0)
    path = str(tmp_path / "untrained.pt")
    model.save(model.CausalLM(tokenizer.VOCAB_SIZE, block_size), path)
    data.write_jsonl(str(tmp_path / "heldout.jsonl"), data.generate_documents(200, 99))  # as seeded in S3
    return evaluate.evaluate(path, str(tmp_path / "heldout.jsonl"))["perplexity"]


def test_text_pipeline_tokenizes_packs_trains_evaluates_and_publishes(airflow_db, pipeline_env, tmp_path, capsys):
    env = {**pipeline_env, "AIRFLOW__CORE__DAGS_FOLDER": os.path.dirname(DAG_FILE),
           "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps([bundle("dags-folder",
                                                                                os.path.dirname(DAG_FILE))])}
    started = time.monotonic()
    proc = subprocess.run([os.path.join(BIN, "airflow"), "dags", "test", DAG, TEXT_DATE, "-f", DAG_FILE,
                           "--conf", json.dumps({"epochs": 4})], env=env, capture_output=True, text=True, timeout=900)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    # What training read: the staged dataset, tokenized and packed into 64-token blocks.
    shared = pipeline_env["DTRAIN_SHARED_FS"]
    with open(os.path.join(shared, "datasets", DAG, "v1", TEXT_DATE, "manifest.json"), encoding="utf-8") as fh:
        manifest = json.load(fh)
    assert manifest["fields"] == {"input_ids": {"dtype": "uint16", "shape": [64]}}
    packing = manifest["packing"]
    assert packing["field"] == "input_ids" and packing["block_size"] == 64 and packing["separator"] == 1
    assert packing["sequences"] == 600 and manifest["dropped"] == 1 and manifest["bad_records"] == 0
    assert packing["tokens"] == 64 * manifest["num_samples"] + packing["dropped_tokens"]
    assert manifest["transform"]["version"].startswith("1+tokenizer.")

    with open(os.path.join(shared, "models", DAG, "v1", TEXT_DATE, "metrics.json"), encoding="utf-8") as fh:
        record = json.load(fh)
    assert record["pipeline"] == DAG and record["world_size"] == 2
    training = record["training"]
    assert training["blocks"] == manifest["num_samples"] and training["block_size"] == 64
    assert training["epochs"] == 4 and training["steps"] == 4 * (manifest["num_samples"] // 2 // 16)
    evaluation = record["evaluation"]
    assert evaluation["documents"] == 200 and evaluation["tokens"] > 5000
    baseline = untrained_perplexity(tmp_path, 64)
    assert evaluation["perplexity"] < 50 and evaluation["perplexity"] < baseline / 10, (evaluation, baseline)
    assert record["gate"]["publish"] and record["gate"]["reasons"][0].endswith("<= threshold 50")
    assert os.path.isfile(os.path.join(shared, "models", DAG, "v1", TEXT_DATE, "model.pt"))
    # Beside the model in its run directory, the tokenizer it was trained with: what the example's MLflow
    # DAG logs with each version (artifacts={"tokenizer": "tokenizer.json"}; tests/mlflow/test_registry.py).
    run_dir = os.path.dirname(training["model_path"])
    assert run_dir == os.path.join(shared, "runs", DAG, "v1", TEXT_DATE, "run-0"), training
    with open(os.path.join(run_dir, "tokenizer.json"), "rb") as written, \
            open(example_module(TEXT, "text_pipeline.tokenizer").PATH, "rb") as committed:
        assert written.read() == committed.read()
    assert "PUBLISHED model:" in proc.stdout and "demo-secret-key" not in proc.stdout + proc.stderr
    with capsys.disabled():
        print(f"\n[e2e] airflow dags test {DAG} (1x2, 4 epochs, {manifest['num_samples']} blocks of 64): "
              f"{elapsed:.1f} s; held-out perplexity {evaluation['perplexity']:.1f} (untrained {baseline:.1f})")
