"""Real Airflow 3 services for end-to-end tests, on SQLite and loopback (tests/deployment.py: on
PostgreSQL with the CeleryExecutor, each component on a host of its own).

:class:`AirflowServices` runs Airflow's components as separate processes (api-server,
scheduler, dag-processor, triggerer), so a test can kill and restart one of them, and
talks to the REST API. ``tests/pipeline`` runs them all at once with ``airflow standalone``
(a subclass there).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import quote

import psutil

from tests.support import kill_survivors

BIN = os.path.dirname(sys.executable)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bundle(name: str, path: str) -> dict:
    return {"name": name, "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle", "kwargs": {"path": path}}


class AirflowServices:
    #: the metadata database is SQLite (its write lock: :meth:`request` sends a refused call again)
    sqlite = True

    def __init__(self, home: str, env: dict[str, str], dags_folder: str, bundles: list[dict] | None = None):
        self.home, self.env = home, env
        self.port = free_port()
        self.env.update(
            AIRFLOW_HOME=home, AIRFLOW__API__PORT=str(self.port), AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{self.port}",
            AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{self.port}/execution/",
            AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True", AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
            AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CORE__DAGS_FOLDER=dags_folder,
            AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST=json.dumps(bundles or [bundle("dags-folder", dags_folder)]),
            AIRFLOW__CORE__PARALLELISM="4",
            # An idle scheduler loop sleeps this long (default 1 s) before it looks again: every
            # task of a run waits for it once its upstream ended (~0.8 s a hop, ten hops a pipeline
            # run). 0.25 s costs the idle scheduler ~5-6% of one core (measured), well below what
            # the runs themselves need, and starts each next task sooner.
            AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME="0.25",
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS="dtrain.pipeline.sqlite.CONNECT_ARGS",
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC="dtrain.pipeline.sqlite.CONNECT_ARGS",
        )
        self.base_url = f"http://127.0.0.1:{self.port}"  # the UI's, and the API's under /api/v2
        self.url = f"{self.base_url}/api/v2"
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: list[psutil.Process] = []  # every process started, for stop()

    def airflow(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([os.path.join(BIN, "airflow"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def migrate(self) -> None:
        os.makedirs(self.home, exist_ok=True)
        migrated = self.airflow("db", "migrate")
        assert migrated.returncode == 0, migrated.stderr[-2000:]

    def spawn(self, name: str, *argv: str, popen=None) -> subprocess.Popen:
        """Start ``airflow <argv>`` as component ``name``, in its own session, logging to <home>/<name>.log
        (with ``popen(argv, **kwargs)`` when given: on another host, tests/deployment.py)."""
        log = open(os.path.join(self.home, f"{name}.log"), "a")
        popen = popen or (lambda cmd, **kw: subprocess.Popen(cmd, env=self.env, **kw))
        proc = popen([os.path.join(BIN, "airflow"), *argv], stdout=log, stderr=subprocess.STDOUT,
                     start_new_session=True)
        self.procs[name] = proc
        self.started.append(psutil.Process(proc.pid))
        return proc

    def kill(self, name: str) -> None:
        """SIGKILL component ``name`` and every process it started, as a crash would."""
        proc = self.procs.pop(name)
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for child in tree:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=30)

    def log(self, name: str) -> str:
        path = os.path.join(self.home, f"{name}.log")
        return open(path).read() if os.path.exists(path) else ""

    def scheduler_log(self) -> str:
        """What every scheduler of this Airflow logged: ``airflow standalone``'s own (in its log) and
        the one :meth:`revive_scheduler` started after it died (scheduler.log). A test that waits for
        a scheduler's line must read both, or it waits forever once the first scheduler has died."""
        return self.log("standalone") + self.log("scheduler")

    def wait_ready(self, dag_id: str, timeout: float = 180) -> None:
        """Until the API answers and the DAG processor has parsed ``dag_id``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status, _ = self.request("GET", f"/dags/{dag_id}")
                if status == 200:
                    return
            except OSError:
                pass
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited:\n{self.log(name)[-3000:]}"
            time.sleep(0.5)  # one cheap GET: asking often costs nothing, and each test starts sooner
        raise AssertionError(f"Airflow not ready with {dag_id} in {timeout}s:\n"
                             + "\n".join(f"--- {n}:\n{self.log(n)[-1500:]}" for n in self.procs))

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
                if self.sqlite and e.code == 500 and "Database error" in json.dumps(payload) and not last:
                    time.sleep(2)
                    continue
                return e.code, payload
            except TimeoutError:
                if last:
                    raise
        raise AssertionError("unreachable")

    def trigger(self, dag_id: str, run_id: str, conf: dict) -> dict:
        """Create a run by REST, idempotently (a timed-out first attempt may have created it)."""
        status, run = self.request("POST", f"/dags/{dag_id}/dagRuns",
                                   {"dag_run_id": run_id, "logical_date": None, "conf": conf})
        if status == 409:
            status, run = self.request("GET", f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")
        assert status == 200, run
        return run

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict:
        status, ti = self.request("GET", f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}")
        assert status == 200, ti
        return ti

    def revive_scheduler(self) -> bool:
        """Start ``airflow scheduler`` again when the one ``airflow standalone`` started has died, as a
        deployment's process supervisor would (``standalone`` never restarts a component). Airflow 3.3 on
        SQLite: ``backfill create`` that hits "database is locked" deletes the runs it had already
        committed, and a scheduler holding one of them crashes (StaleDataError on dag_run). Returns
        whether it started one (its output goes to <home>/scheduler.log)."""
        standalone = self.procs.get("standalone")
        if standalone is None or standalone.poll() is not None:
            return False
        if "scheduler" in self.procs and self.procs["scheduler"].poll() is None:
            return False
        try:
            children = psutil.Process(standalone.pid).children()
        except psutil.NoSuchProcess:
            return False
        if any(_is_live_scheduler(child) for child in children):
            return False
        self.spawn("scheduler", "scheduler")
        return True

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.revive_scheduler()
            status, run = self.request("GET", f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")
            if status == 200 and run["state"] in ("success", "failed"):
                return run
            time.sleep(1)  # one cheap GET a second: the test goes on about a second after the run ends
        raise AssertionError(f"run {run_id} of {dag_id} did not finish in {timeout}s")

    def failure_report(self, dag_id: str, run_id: str) -> str:
        """The log tails of the run's failed tasks (for assertion messages)."""
        base = f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances"
        _, tis = self.request("GET", base)
        out = []
        for ti in tis.get("task_instances", []):
            if ti["state"] != "failed":
                continue
            path = f"{base}/{ti['task_id']}/logs/{max(ti['try_number'], 1)}?map_index={ti['map_index']}&full_content=true"
            status, body = self.request("GET", path)
            content = body.get("content", []) if status == 200 else []
            text = "\n".join(_log_line(item) for item in content)
            text = text or f"(no log: HTTP {status})"
            out.append(f"--- {ti['task_id']}[{ti['map_index']}] try {ti['try_number']}:\n{text[-3000:]}")
        return "\n".join(out) or "\n".join(f"--- {n}:\n{self.log(n)[-3000:]}" for n in self.procs)

    def stop(self) -> None:
        """Stop every component and whatever it started: nothing may outlive the test."""
        tree = []
        for proc in self.started:
            try:
                tree += [proc] + proc.children(recursive=True)  # Airflow's processes rewrite their title
            except psutil.NoSuchProcess:
                continue
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        kill_survivors(tree, timeout=10)
        # Whatever it started carries its AIRFLOW_HOME (where still readable).
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("AIRFLOW_HOME") == self.home:
                    proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        self.procs.clear()


def _is_live_scheduler(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and "scheduler" in " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return False  # gone, or a zombie the standalone has not reaped


def _log_line(item) -> str:
    """One task-log entry as text, with the exception when Airflow logged one (error_detail)."""
    if not isinstance(item, dict):
        return str(item)
    line = str(item.get("event", item))
    for detail in item.get("error_detail") or []:
        if isinstance(detail, dict):
            line += f"\n  {detail.get('exc_type')}: {detail.get('exc_value')}"
            frames = detail.get("frames") or []
            line += "".join(f"\n    {f.get('filename')}:{f.get('lineno')} {f.get('name')}" for f in frames[-6:])
    return line
