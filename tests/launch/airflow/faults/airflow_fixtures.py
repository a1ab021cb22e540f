"""Real Airflow for the re-attach and retry tests, and the way to crash a task's worker.

:func:`airflow_running` starts Airflow's components as separate processes on SQLite (api-server,
scheduler with its LocalExecutor, dag-processor: tests/airflow_services.py), reading the DAGs of
tests/dags. A task runs as Airflow 3.3 runs it: a LocalExecutor worker process supervises a task
process (both titled with the task instance's id), talking to the api-server's execution API.
:func:`crash_worker` SIGKILLs that worker and everything it started, as a lost machine would; the
scheduler then finds the task without heartbeats, fails the try and schedules the retry.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Iterator
from urllib.parse import quote

import psutil

from tests.airflow_services import AirflowServices, bundle

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
DAGS = os.path.join(REPO, "tests", "dags")
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
RESUMABLE_TRAIN = os.path.join(SCRIPTS, "resumable_train.py")
# A killed worker stops heartbeating; the scheduler fails its try this long after the last beat
# (the supervisor beats about every 5 s; 30 s leaves room on 2 loaded cores).
HEARTBEAT_TIMEOUT_S = 30


@contextlib.contextmanager
def airflow_running(home: str, dag_ids: list[str], env: dict[str, str] | None = None) -> Iterator[AirflowServices]:
    """api-server, scheduler and dag-processor on SQLite until the block ends (then all stopped)."""
    env = dict(os.environ if env is None else env)
    env.update(AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT_S),
               AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL="3")
    services = AirflowServices(home, env, DAGS, [bundle("test-dags", DAGS)])
    try:
        services.migrate()
        for name in ("api-server", "scheduler", "dag-processor"):
            services.spawn(name, name)
        for dag_id in dag_ids:
            services.wait_ready(dag_id)
        yield services
    finally:
        services.stop()


def worker_processes(ti_id: str) -> list[psutil.Process]:
    """The task instance's worker: the LocalExecutor process supervising it and the task process
    (their titles carry the task instance id), with everything they started."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if ti_id in " ".join(proc.info["cmdline"] or ()):
                for p in [proc, *proc.children(recursive=True)]:
                    found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return list(found.values())


def crash_worker(ti_id: str) -> list[int]:
    """SIGKILL the task instance's worker and all it started, at once (no handler runs, nothing
    is cleaned up: a lost machine). Returns the PIDs killed."""
    procs = worker_processes(ti_id)
    assert procs, f"no worker process for task instance {ti_id}"
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    return [p.pid for p in procs]


def tries(services: AirflowServices, dag_id: str, run_id: str, task_id: str) -> list[dict]:
    """Every try of the task instance so far (its history), oldest first."""
    path = f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/tries"
    status, body = services.request("GET", path)
    assert status == 200, body
    return sorted(body["task_instances"], key=lambda t: t["try_number"])


def task_log(services: AirflowServices, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
    path = (f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/logs/{try_number}"
            "?full_content=true")
    status, body = services.request("GET", path)
    if status != 200:
        return f"(no log: HTTP {status})"
    return "\n".join(str(item.get("event", item)) if isinstance(item, dict) else str(item)
                     for item in body.get("content", []))
