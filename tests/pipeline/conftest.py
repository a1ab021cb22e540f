"""Fixtures for the pipeline's end-to-end tests: moto's S3 server seeded with raw data, the
environment a real Airflow process needs to run retrain_pipeline against it, and a real
`airflow standalone` (API server, scheduler, DAG processor, triggerer; SQLite)."""

from __future__ import annotations

import os

import pytest

from dtrain.pipeline.demo import airflow_env, moto_s3, seed_raw
from tests.airflow_services import BIN, REPO, AirflowServices  # noqa: F401 (BIN re-exported to the tests)

DATES = ["2026-01-01", "2026-01-02", "2026-01-03", "2026-01-04", "2026-02-01"]


@pytest.fixture(scope="session")
def s3_endpoint():
    with moto_s3() as endpoint:
        seed_raw(endpoint, DATES)
        yield endpoint


@pytest.fixture(scope="session")
def pipeline_env(s3_endpoint, tmp_path_factory) -> dict[str, str]:
    """Env for an `airflow` process: the AWS connection, a fresh shared filesystem and DTRAIN_HOME."""
    root = tmp_path_factory.mktemp("pipeline")
    env = airflow_env(s3_endpoint)
    env.update(DTRAIN_SHARED_FS=str(root / "shared"), DTRAIN_HOME=str(root / "dtrain"),
               PATH=BIN + os.pathsep + env.get("PATH", ""))
    return env


class Standalone(AirflowServices):
    """Every component at once, as users first run Airflow: ``airflow standalone``."""

    def __init__(self, home: str, env: dict[str, str]):
        super().__init__(home, env, os.path.join(REPO, "dags"))

    def start(self, timeout: float = 180) -> None:
        self.migrate()
        self.spawn("standalone", "standalone")
        self.wait_ready("retrain_pipeline", timeout)


@pytest.fixture(scope="session")
def standalone(pipeline_env, tmp_path_factory):
    server = Standalone(str(tmp_path_factory.mktemp("standalone") / "home"), dict(pipeline_env))
    try:
        server.start()
        yield server
    finally:
        server.stop()
