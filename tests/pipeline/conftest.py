"""Fixtures for the pipeline's end-to-end tests: moto's S3 server seeded with raw data, the
environment a real Airflow process needs to run retrain_pipeline against it, and a real
`airflow standalone` (API server, scheduler, DAG processor, triggerer; SQLite)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest

from operators.pipeline.demo import airflow_env, moto_s3, seed_raw

BIN = os.path.dirname(sys.executable)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Standalone:
    def __init__(self, home: str, env: dict[str, str]):
        self.home, self.env = home, env
        self.port = free_port()
        self.env.update(
            AIRFLOW_HOME=home, AIRFLOW__API__PORT=str(self.port), AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{self.port}",
            AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True", AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
            AIRFLOW__CORE__DAGS_FOLDER=os.path.join(REPO, "dags"),
            AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST=json.dumps([{
                "name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
                "kwargs": {"path": os.path.join(REPO, "dags")}}]),
            AIRFLOW__CORE__PARALLELISM="4",
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS="operators.pipeline.sqlite.CONNECT_ARGS",
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC="operators.pipeline.sqlite.CONNECT_ARGS",
        )
        self.url = f"http://127.0.0.1:{self.port}/api/v2"
        self.log_path = os.path.join(home, "standalone.log")
        self.proc: subprocess.Popen | None = None

    def airflow(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([os.path.join(BIN, "airflow"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def start(self, timeout: float = 180) -> None:
        os.makedirs(self.home, exist_ok=True)
        migrated = self.airflow("db", "migrate")
        assert migrated.returncode == 0, migrated.stderr[-2000:]
        self.proc = subprocess.Popen([os.path.join(BIN, "airflow"), "standalone"], env=self.env,
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status, dag = self.request("GET", "/dags/retrain_pipeline")
                if status == 200:
                    return
            except OSError:
                pass
            assert self.proc.poll() is None, open(self.log_path).read()[-3000:]
            time.sleep(2)
        raise AssertionError(f"airflow standalone not ready in {timeout}s:\n" + open(self.log_path).read()[-3000:])

    def request(self, method: str, path: str, body: dict | None = None, attempts: int = 5) -> tuple[int, dict]:
        """One API call. On 2 loaded cores the API server can stall behind SQLite's lock, or fail a
        read-to-write upgrade at once with "database is locked" (a 500 "Database error"; SQLite
        refuses that upgrade without waiting). Either way the call is sent again: callers make
        POSTs idempotent with an explicit dag_run_id, and a refused transaction left nothing."""
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(attempts):
            last = attempt == attempts - 1
            req = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=90) as resp:
                    return resp.status, json.loads(resp.read() or b"{}")
            except urllib.error.HTTPError as e:
                payload = json.loads(e.read() or b"{}")
                if e.code == 500 and "Database error" in json.dumps(payload) and not last:
                    time.sleep(2)
                    continue
                return e.code, payload
            except TimeoutError:
                if last:
                    raise
        raise AssertionError("unreachable")

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 600) -> dict:
        from urllib.parse import quote

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, run = self.request("GET", f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")
            if status == 200 and run["state"] in ("success", "failed"):
                return run
            time.sleep(3)
        raise AssertionError(f"run {run_id} of {dag_id} did not finish in {timeout}s")

    def failure_report(self, dag_id: str, run_id: str) -> str:
        """The log tails of the run's failed tasks (for assertion messages)."""
        from urllib.parse import quote

        base = f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances"
        _, tis = self.request("GET", base)
        out = []
        for ti in tis.get("task_instances", []):
            if ti["state"] != "failed":
                continue
            path = f"{base}/{ti['task_id']}/logs/{max(ti['try_number'], 1)}?map_index={ti['map_index']}&full_content=true"
            status, body = self.request("GET", path)
            content = body.get("content", []) if status == 200 else []
            text = "\n".join(str(item.get("event", item)) if isinstance(item, dict) else str(item) for item in content)
            text = text or f"(no log: HTTP {status})"
            out.append(f"--- {ti['task_id']}[{ti['map_index']}] try {ti['try_number']}:\n{text[-3000:]}")
        return "\n".join(out) or open(self.log_path).read()[-3000:]

    def stop(self) -> None:
        if self.proc is None:
            return
        try:  # Airflow's processes rewrite their title and environ area: find them by ancestry too
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        _, survivors = psutil.wait_procs(tree, timeout=10)
        for proc in survivors:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        # Whatever it started carries its AIRFLOW_HOME (where still readable): none may outlive the test.
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("AIRFLOW_HOME") == self.home:
                    proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue


@pytest.fixture(scope="session")
def standalone(pipeline_env, tmp_path_factory):
    server = Standalone(str(tmp_path_factory.mktemp("standalone") / "home"), dict(pipeline_env))
    try:
        server.start()
        yield server
    finally:
        server.stop()
