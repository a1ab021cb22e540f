"""Fixtures for the pipeline's end-to-end tests: moto's S3 server seeded with raw data, the
environment a real Airflow process needs to run retrain_pipeline against it, and a real Airflow
deployment (tests/deployment.py: PostgreSQL, CeleryExecutor, each component on a host of its own)."""

from __future__ import annotations

import os

import pytest

from dtrain.pipeline.demo import airflow_env, s3_client, seed_raw
from tests.pipeline import readme_package
from tests.airflow_services import BIN, REPO, bundle  # noqa: F401 (BIN re-exported to the tests)
from tests.deployment import celery_deployment

DATES = ["2026-01-01", "2026-01-02", "2026-01-03", "2026-01-04", "2026-02-01"]
#: the example pipeline (examples/tabular): a user's own package, found through PYTHONPATH
TABULAR = os.path.join(REPO, "examples", "tabular")
#: the DAG bundle of the package test_readme_pipeline.py writes while Airflow runs, as a new user deploys theirs
README_BUNDLE = "readme-user"
#: the Training tab's test DAG (tests/pipeline/test_ui_browser.py)
UI_DAGS = os.path.join(REPO, "tests", "ui", "dags")
TABULAR_BUCKET = "tabular-demo"
#: the text example (examples/text): a causal language model on JSON-lines documents
TEXT = os.path.join(REPO, "examples", "text")
TEXT_BUCKET = "text-demo"
TEXT_DATE = "2026-03-01"
#: date -> (rows, label noise): 03-03's labels are noisy, so its model is worse than 03-02's
TABULAR_DATES = {"2026-02-27": (2000, 0.1), "2026-03-01": (2000, 0.1), "2026-03-02": (3000, 0.1),
                 "2026-03-03": (3000, 3.0), "2026-03-10": (2000, 0.1), "2026-03-11": (2000, 0.1)}


def example_module(folder: str, name: str):
    """A module of an example's package, imported as its team's PYTHONPATH would find it."""
    import importlib
    import sys

    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def seed_tabular(endpoint: str) -> None:
    """Raw CSV per date under raw/v1/<date>/ and one held-out CSV, as the example's team would upload them."""
    data = example_module(TABULAR, "tabular_pipeline.data")
    csv_bytes, generate_rows = data.csv_bytes, data.generate_rows
    client = s3_client(endpoint)
    client.create_bucket(Bucket=TABULAR_BUCKET)
    for seed, (date, (rows, noise)) in enumerate(sorted(TABULAR_DATES.items()), start=1):
        client.put_object(Bucket=TABULAR_BUCKET, Key=f"raw/v1/{date}/part-0.csv",
                          Body=csv_bytes(generate_rows(rows, seed, label_noise=noise)))
    client.put_object(Bucket=TABULAR_BUCKET, Key="heldout/v1/heldout.csv", Body=csv_bytes(generate_rows(1000, 99)))


def seed_text(endpoint: str) -> None:
    """One day of documents (and one without text, which the transform drops) and a held-out set."""
    data = example_module(TEXT, "text_pipeline.data")
    client = s3_client(endpoint)
    client.create_bucket(Bucket=TEXT_BUCKET)
    docs = data.generate_documents(600, 1) + [{"id": "untitled", "text": ""}]
    client.put_object(Bucket=TEXT_BUCKET, Key=f"raw/v1/{TEXT_DATE}/part-0.jsonl", Body=data.jsonl_bytes(docs))
    client.put_object(Bucket=TEXT_BUCKET, Key="heldout/v1/heldout.jsonl",
                      Body=data.jsonl_bytes(data.generate_documents(200, 99)))


@pytest.fixture(scope="session")
def s3_endpoint(moto_endpoint):
    """The suite's moto server (tests/services.py), with the pipelines' buckets seeded."""
    seed_all(moto_endpoint)
    return moto_endpoint


@pytest.fixture(scope="session")
def pipeline_env(s3_endpoint, tmp_path_factory) -> dict[str, str]:
    """Env for an `airflow` process: the AWS connection, a fresh shared filesystem and DTRAIN_HOME."""
    root = tmp_path_factory.mktemp("pipeline")
    # Empty until test_readme_pipeline.py writes a new user's package there (readme_package.py).
    readme_user = root / "readme_user"
    (readme_user / "dags").mkdir(parents=True)
    env = airflow_env(s3_endpoint)
    env.update(DTRAIN_SHARED_FS=str(root / "shared"), DTRAIN_HOME=str(root / "dtrain"),
               PATH=BIN + os.pathsep + env.get("PATH", ""),
               TABULAR_BUCKET=f"s3://{TABULAR_BUCKET}", TABULAR_SHARED_FS=str(root / "shared"),
               TEXT_BUCKET=f"s3://{TEXT_BUCKET}", TEXT_SHARED_FS=str(root / "shared"),
               README_USER=str(readme_user),
               # A task's first call to the API server (5 s by default) timed out on these shared cores
               # while the API server waited on SQLite, and failed the task before it ran (Airflow's own
               # advice for high load: raise it).
               AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT="60",
               PYTHONPATH=os.pathsep.join(p for p in (TABULAR, TEXT, str(readme_user), env.get("PYTHONPATH")) if p))
    return env


def seed_all(endpoint: str) -> None:
    """Every bucket the pipelines' tests read, on the S3 server at ``endpoint``."""
    seed_raw(endpoint, DATES)
    seed_tabular(endpoint)
    seed_text(endpoint)
    readme_package.seed_moons(s3_client(endpoint))


#: the DAGs every test of the deployment waits for before it starts
DEPLOYMENT_DAGS = ("retrain_pipeline", "tabular_retraining_reviewed", "ui_training")


@pytest.fixture(scope="package")  # stopped when tests/pipeline ends: no idle Airflow under later tests
def deployment(pipeline_env, tmp_path_factory):
    """Airflow as production runs it (tests/deployment.py: PostgreSQL, Celery workers, every component on a
    host of its own) with the pipelines, the Training tab's test DAG and the README user's package as its
    bundles. Its tasks read S3 from a server of its own (seeded like the session's)."""
    dags = os.path.join(REPO, "dags")
    bundles = [bundle("dags-folder", dags), bundle("tabular", os.path.join(TABULAR, "dags")),
               bundle("ui-test-dags", UI_DAGS), bundle(README_BUNDLE, os.path.join(pipeline_env["README_USER"], "dags"))]
    home = str(tmp_path_factory.mktemp("deployment") / "home")
    with celery_deployment(home, dict(pipeline_env), dags, bundles, list(DEPLOYMENT_DAGS), seed_s3=seed_all) as airflow:
        yield airflow
