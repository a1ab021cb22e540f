"""A real MLflow tracking server for the registry and tracking tests: `mlflow server` on loopback,
SQLite backend store and a local artifact root in a temp dir, as the MLflow docs set one up offline.

The server runs from this venv (the full `mlflow` package of the `test` extra resolves beside
Airflow here; the product itself needs only the client, `mlflow-skinny`: docs/mlflow.md)."""

from __future__ import annotations

import os
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
    """``mlflow server`` in its own session; :meth:`stop` ends it and every worker it started."""

    def __init__(self, root: str):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(root, "mlflow-server.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        argv = [os.path.join(BIN, "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--workers", "1", "--backend-store-uri", f"sqlite:///{os.path.join(self.root, 'mlflow.db')}",
                "--artifacts-destination", os.path.join(self.root, "artifacts")]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
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
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        kill_survivors(procs, timeout=10)
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
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
