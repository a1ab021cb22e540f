"""A real MLflow tracking server for the registry and tracking tests: `mlflow server` on loopback,
SQLite backend store and a local artifact root in a temp dir, as the MLflow docs set one up offline.

The server runs from this venv (the full `mlflow` package of the `test` extra resolves beside
Airflow here; the product itself needs only the client, `mlflow-skinny`: docs/mlflow.md)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request

import psutil
import pytest

from tests.airflow_services import BIN, free_port
from tests.support import kill_survivors

#: the server's first start migrates its SQLite store: about 40 s on 2 busy cores
START_TIMEOUT = 240


class MlflowServer:
    """``mlflow server`` in its own session, listening on ``host``; :meth:`stop` ends it and every worker
    it started."""

    def __init__(self, root: str, host: str = "127.0.0.1"):
        self.root, self.host = root, host
        self.port = free_port()
        self.uri = f"http://{host}:{self.port}"
        self.log_path = os.path.join(root, "mlflow-server.log")
        self.proc: subprocess.Popen | None = None
        self.shm_before: set[str] = set()

    def start(self) -> None:
        self.shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        argv = [os.path.join(BIN, "mlflow"), "server", "--host", self.host, "--port", str(self.port),
                "--workers", "1", "--backend-store-uri", f"sqlite:///{os.path.join(self.root, 'mlflow.db')}",
                "--artifacts-destination", os.path.join(self.root, "artifacts")]
        # No job runner: the product runs no MLflow server jobs, and its huey consumers poll all the time.
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=self.root, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"mlflow server exited {self.proc.returncode}: {self.log()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"mlflow server not ready after {START_TIMEOUT} s: {self.log()[-3000:]}")

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        scratch = self.shm_dirs(procs)
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        kill_survivors(procs, timeout=10)
        self.proc.wait(timeout=10)
        for directory in scratch | self.new_shm_dirs():
            shutil.rmtree(directory, ignore_errors=True)

    def new_shm_dirs(self) -> set[str]:
        """/dev/shm temp dirs made since the server started that hold nothing or only its job stores."""
        found: set[str] = set()
        if not os.path.isdir("/dev/shm"):
            return found
        for name in set(os.listdir("/dev/shm")) - self.shm_before:
            path = os.path.join("/dev/shm", name)
            if name.startswith("tmp") and os.path.isdir(path) and not os.path.islink(path) and all(
                    ".mlflow-huey-store" in entry for entry in os.listdir(path)):
                found.add(path)
        return found

    @staticmethod
    def shm_dirs(procs) -> set[str]:
        """The server's job store: ``mlflow server`` makes a temp dir in /dev/shm (mlflow/server/__init__.py)
        and leaves it when stopped; found by the files its processes hold open there."""
        found = set()
        for proc in procs:
            try:
                files = proc.open_files()
            except psutil.Error:
                continue
            for f in files:
                parts = f.path.split(os.sep)
                if f.path.startswith("/dev/shm/tmp") and len(parts) > 3:
                    found.add(os.sep.join(parts[:4]))
        return found


@pytest.fixture(scope="package")  # stopped when tests/mlflow ends: no idle daemon under later tests
def mlflow_server(tmp_path_factory):
    server = MlflowServer(str(tmp_path_factory.mktemp("mlflow")))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(mlflow_server):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)


#: the e2e test's own bucket: the example's CSV data, dates chosen so that each outcome is the data's
#: doing: date -> (rows, label noise). More clean data, warm-started from the champion, beats it;
#: noisy labels do not.
E2E_BUCKET = "mlflow-demo"
E2E_DATES = {"2026-04-01": (2000, 0.1), "2026-04-02": (4000, 0.1), "2026-04-03": (3000, 3.0),
             "2026-04-04": (6000, 0.1)}
E2E_DAGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dags")


def seed_e2e(endpoint: str) -> None:
    from dtrain.pipeline.demo import s3_client
    from tests.pipeline.conftest import TABULAR, example_module

    data = example_module(TABULAR, "tabular_pipeline.data")
    client = s3_client(endpoint)
    client.create_bucket(Bucket=E2E_BUCKET)
    for seed, (date, (rows, noise)) in enumerate(sorted(E2E_DATES.items()), start=11):
        client.put_object(Bucket=E2E_BUCKET, Key=f"raw/v1/{date}/part-0.csv",
                          Body=data.csv_bytes(data.generate_rows(rows, seed, label_noise=noise)))
    client.put_object(Bucket=E2E_BUCKET, Key="heldout/v1/heldout.csv",
                      Body=data.csv_bytes(data.generate_rows(1000, 99)))


@pytest.fixture(scope="package")  # stopped when tests/mlflow ends: no idle Airflow under later tests
def mlflow_airflow(mlflow_server, moto_endpoint, tmp_path_factory):
    """`airflow standalone` with tests/mlflow/dags, the suite's moto S3 (tests/services.py) seeded for
    it, and the connection mlflow_default pointing at the session's tracking server."""
    from dtrain.pipeline.demo import airflow_env
    from tests.airflow_services import AirflowServices, bundle
    from tests.pipeline.conftest import TABULAR

    class Standalone(AirflowServices):
        def start(self, timeout: float = 240) -> None:
            self.migrate()
            self.spawn("standalone", "standalone")
            self.wait_ready("tabular_mlflow", timeout)

    root = tmp_path_factory.mktemp("mlflow-airflow")
    seed_e2e(moto_endpoint)
    env = airflow_env(moto_endpoint)
    env.update(DTRAIN_SHARED_FS=str(root / "shared"), DTRAIN_HOME=str(root / "dtrain"),
               PATH=BIN + os.pathsep + env.get("PATH", ""), TABULAR_BUCKET=f"s3://{E2E_BUCKET}",
               TABULAR_SHARED_FS=str(root / "shared"), AIRFLOW_CONN_MLFLOW_DEFAULT=mlflow_server.uri,
               PYTHONPATH=os.pathsep.join(p for p in (TABULAR, env.get("PYTHONPATH")) if p))
    server = Standalone(str(root / "home"), env, E2E_DAGS, [bundle("mlflow-dags", E2E_DAGS)])
    try:
        server.start()
        yield server
    finally:
        server.stop()
