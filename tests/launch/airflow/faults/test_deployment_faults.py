"""A worker's or the triggerer's machine failing, in Airflow as production runs it (tests/deployment.py:
PostgreSQL, two Celery workers and the triggerer each on a host of its own), while its task follows an
ssh training job on two more hosts (sshd on each: the job's nodes survive what happens to a worker).

* a worker host crashes (every process on it killed) mid-training: the scheduler fails the try when
  its heartbeats stop, the retry runs on the other worker and re-attaches to the running job;
* a worker host is cut off (its link down) mid-training, then reconnected: the same, and the cut-off
  try, stopped by its worker, leaves the job to the retry;
* a worker host freezes mid-training and thaws after the retry re-attached: the thawed try is told
  by Airflow it should not run any more and is stopped; the job the retry follows runs on;
* the triggerer's host crashes while it follows a deferred job: a triggerer on another host takes
  the trigger over and the task completes from the same job.

Each asserts exactly one job ran (one start per rank, one job id) and nothing of it is left.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.airflow_services import bundle
from tests.deployment import WORKERS, celery_deployment
from tests.launch.airflow.faults.airflow_fixtures import DAGS, task_log, tries
from tests.launch.airflow.faults.test_reattach import JOB_SECONDS, assert_one_job_trained, crash_mid_training_then_retry, starts
from tests.remote_jobs import job_processes
from tests.support import wait_for

REATTACH = "fault_reattach_ssh"
DEFERRED = "ssh_deferrable_test"
# The scheduler fails a try whose heartbeats stopped this long ago (tests/launch/airflow/faults/test_reattach.py: with a
# beat every second, 15 s is 14 missed beats) and a triggerer silent for this long loses its triggers.
HEARTBEAT_TIMEOUT_S = 15
TRIGGERER_HEALTH_S = 5


@pytest.fixture(scope="module")
def production(tmp_path_factory):
    env = dict(os.environ,
               AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT_S),
               AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL="3",
               AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL="1",
               AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC="1",
               AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD=str(TRIGGERER_HEALTH_S))
    home = str(tmp_path_factory.mktemp("production") / "home")
    with celery_deployment(home, env, DAGS, [bundle("test-dags", DAGS)], [REATTACH, DEFERRED],
                           training_hosts=2) as deployment:
        yield deployment


@pytest.fixture
def prod(production):
    """The deployment with both workers and a triggerer up; what a test broke (a host frozen, cut off,
    crashed; a component stopped) is mended after it, pass or fail: hosts thawed and reconnected, stopped
    workers started again, a triggerer started on its host if none runs."""
    yield production
    for host in production.worker_hosts:
        production.net.thaw(host.index)
        production.net.heal(host.index)
    stopped = [i for i, name in enumerate(WORKERS) if name not in production.procs
               or production.procs[name].poll() is not None]
    if stopped:
        production.start_workers(*stopped)
    if not any(name.startswith("triggerer") and proc.poll() is None for name, proc in production.procs.items()):
        production.spawn_on(production.triggerer_host, "triggerer", "triggerer")


def worker_index(prod, ti: dict) -> int:
    """Which Celery worker runs the task instance (its hostname is the worker's host address)."""
    [index] = [i for i, host in enumerate(prod.worker_hosts) if host.address == ti["hostname"]]
    return index


def job_alive(out) -> bool:
    [job] = {s["job"] for s in starts(out)}
    return len(job_processes(job)) >= 4  # on each host: the detached daemon, torchrun, a rank...


def reattach_after(prod, tmp_path, run_id: str, fault) -> tuple[dict, list[dict], str]:
    """Run the re-attach DAG, apply ``fault(worker index)`` to the worker running its task once both ranks
    train; returns the task's result, its tries and the retry's log (crash_mid_training_then_retry checks
    that the retry re-attached to the job, which was still running, and that the run succeeded)."""
    out = tmp_path / "out"
    conf = {"out_dir": str(out), "sleep": JOB_SECONDS, "hostfile": prod.training.hostfile(1)}
    faulted = {}

    def crash(ti):
        faulted["worker"] = worker_index(prod, ti)
        fault(faulted["worker"])

    result, retry_log = crash_mid_training_then_retry(prod, REATTACH, conf, out, lambda: job_alive(out),
                                                      crash=crash, run_id=run_id)
    history = tries(prod, REATTACH, run_id, "train")
    hosts = [host.address for host in prod.worker_hosts]
    # Try 1 ran on the worker that failed, the retry on the other one.
    assert [t["hostname"] for t in history] == [hosts[faulted["worker"]], hosts[1 - faulted["worker"]]], history
    job = assert_one_job_trained(out, "job")
    assert result["ssh_job_id"] == job and result["world_size"] == 2
    wait_for(lambda: not job_processes(job), 30, what="the detached nodes to exit")
    return result, history, retry_log


def test_a_crashed_worker_host_the_retry_on_the_other_worker_reattaches(prod, tmp_path):
    result, _, retry_log = reattach_after(prod, tmp_path, "worker-crash",
                                          lambda i: prod.net.crash(prod.worker_hosts[i].index))
    assert "all-reduced sum 3" in retry_log  # the nodes' last lines (detached SSH does not stream)
    assert sorted(n for n in os.listdir(result["run_dir"]) if n.endswith(".submission.json")) == [
        f"ssh-{result['ssh_job_id']}.submission.json"]  # one submission


def test_a_worker_host_cut_off_mid_training_the_retry_reattaches_and_the_job_runs_once(prod, tmp_path):
    cut = []  # the fixture reconnects it if the test fails
    reattach_after(prod, tmp_path, "worker-partition",
                   lambda i: cut.append(i) or prod.net.partition(prod.worker_hosts[i].index))
    # Reconnected, the cut-off try (its worker stopped it when its heartbeats failed) starts nothing.
    prod.net.heal(prod.worker_hosts[cut[0]].index)
    time.sleep(5)
    assert len(starts(tmp_path / "out")) == 2


def test_a_frozen_worker_host_that_thaws_after_the_retry_leaves_the_job_running(prod, tmp_path):
    """The worst order: the frozen try wakes up alive after the retry re-attached. Airflow tells its
    worker the try should not run any more (the heartbeat's 409) and the worker stops it (SIGTERM, so
    on_kill): on_kill must not cancel the job the retry follows."""
    out = tmp_path / "out"
    run_id = "worker-freeze"
    conf = {"out_dir": str(out), "sleep": JOB_SECONDS, "hostfile": prod.training.hostfile(1)}
    prod.trigger(REATTACH, run_id, conf)

    def training():
        ti = prod.task_instance(REATTACH, run_id, "train")
        return ti["state"] == "running" and len(starts(out)) == 2 and ti

    ti = wait_for(training, timeout=300, interval=1, what="the task running and both ranks training")
    frozen = prod.worker_hosts[worker_index(prod, ti)]
    prod.net.freeze(frozen.index)
    wait_for(lambda: "Reconnecting to existing job" in task_log(prod, REATTACH, run_id, "train", 2),
             timeout=JOB_SECONDS - 60, interval=1, what="the retry to re-attach to the running job")
    prod.net.thaw(frozen.index)
    first_log = lambda: task_log(prod, REATTACH, run_id, "train", 1)  # noqa: E731
    wait_for(lambda: "Task killed!" in first_log(), timeout=120, interval=1, what="the thawed try to be stopped")
    assert job_alive(out), "the thawed try's on_kill stopped the job the retry follows:\n" + first_log()[-3000:]
    assert "on_kill: leaving job" in first_log(), first_log()[-3000:]
    (out / "release").touch()
    run = prod.wait_run(REATTACH, run_id, timeout=JOB_SECONDS + 120)
    assert run["state"] == "success", prod.failure_report(REATTACH, run_id)
    job = assert_one_job_trained(out, "job")
    wait_for(lambda: not job_processes(job), 30, what="the detached nodes to exit")


def test_a_rolling_restart_of_every_component_keeps_a_durable_and_a_deferred_job(prod, tmp_path):
    """An upgrade restarts every component in turn, each stopped the way its supervisor stops it
    (:meth:`CeleryDeployment.shut_down`). The worker running the durable task is in its warm shutdown,
    which waits for the task, until its grace ends and it is killed: its retry re-attaches on the
    restarted other worker. The deferred task is followed by the restarted triggerer."""
    durable, deferred = tmp_path / "durable", tmp_path / "deferred"
    deferred.mkdir()
    hostfile = prod.training.hostfile(1)
    prod.trigger(REATTACH, "rolling-durable", {"out_dir": str(durable), "sleep": JOB_SECONDS, "hostfile": hostfile})
    prod.trigger(DEFERRED, "rolling-deferred", {"out_dir": str(deferred), "hostfile": hostfile, "sleep": JOB_SECONDS})

    def both_running():
        ti = prod.task_instance(REATTACH, "rolling-durable", "train")
        other = prod.task_instance(DEFERRED, "rolling-deferred", "train")
        return (ti["state"] == "running" and len(starts(durable)) == 2 and other["state"] == "deferred"
                and triggerer_of(other) and ti)

    busy = worker_index(prod, wait_for(both_running, timeout=300, interval=1, what="both tasks under way"))
    for name in ("scheduler", "dag-processor", "api-server"):
        assert prod.shut_down(name), f"{name} did not stop on SIGTERM"
        prod.spawn_on(prod.api_host, name, name)
        prod.wait_ready(REATTACH)
    triggerer = next(n for n, p in prod.procs.items() if n.startswith("triggerer") and p.poll() is None)
    assert prod.shut_down(triggerer)
    prod.spawn_on(prod.triggerer_host, triggerer, "triggerer")
    for index in (1 - busy, busy):
        # The busy worker's warm shutdown waits for its durable task, until the grace ends; unless the
        # API server's restart (about 20 s here, beyond this module's 15-s heartbeat timeout; Airflow's
        # default is 300 s) already had the scheduler fail the try: its retry then re-attached at once.
        prod.shut_down(WORKERS[index], grace=10)
        prod.start_workers(index)
    assert job_alive(durable) and len(starts(durable)) == 2

    def reattached():
        history = tries(prod, REATTACH, "rolling-durable", "train")
        return len(history) > 1 and "Reconnecting to existing job" in task_log(
            prod, REATTACH, "rolling-durable", "train", history[-1]["try_number"])

    wait_for(reattached, timeout=JOB_SECONDS - 60, interval=1, what="the durable task's retry to re-attach")
    assert job_alive(durable), "the job did not survive the restart"
    for out in (durable, deferred):
        (out / "release").touch()
    assert prod.wait_run(REATTACH, "rolling-durable", timeout=300)["state"] == "success", \
        prod.failure_report(REATTACH, "rolling-durable")
    assert prod.wait_run(DEFERRED, "rolling-deferred", timeout=300)["state"] == "success", \
        prod.failure_report(DEFERRED, "rolling-deferred")
    history = tries(prod, REATTACH, "rolling-durable", "train")
    assert [t["state"] for t in history] == ["failed"] * (len(history) - 1) + ["success"], history
    for retry in history[1:]:  # every retry followed the one job, or took its result once it had ended
        log = task_log(prod, REATTACH, "rolling-durable", "train", retry["try_number"])
        assert "Reconnecting to existing job" in log or "Job already completed successfully" in log, log[-3000:]
    job = assert_one_job_trained(durable, "job")
    ti = prod.task_instance(DEFERRED, "rolling-deferred", "train")
    events = [json.loads(line) for line in (deferred / "events.jsonl").read_text().splitlines()]
    assert ti["try_number"] == 1 and len(events) == 1 and events[0]["status"] == "success", (ti, events)
    wait_for(lambda: not job_processes(job), 30, what="the detached nodes to exit")


def triggerer_of(ti: dict) -> int | None:
    """Id of the triggerer job running this task's trigger, or None."""
    return (ti.get("triggerer_job") or {}).get("id") or (ti.get("trigger") or {}).get("triggerer_id")


def test_the_triggerer_host_crashes_a_triggerer_on_another_host_takes_the_deferred_job_over(prod, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_id = "triggerer-crash"
    prod.trigger(DEFERRED, run_id, {"out_dir": str(out), "hostfile": prod.training.hostfile(1),
                                          "sleep": JOB_SECONDS})

    def deferred_and_followed():
        ti = prod.task_instance(DEFERRED, run_id, "train")
        return ti["state"] == "deferred" and triggerer_of(ti) and ti

    first = triggerer_of(wait_for(deferred_and_followed, timeout=240, interval=1, what="the task deferred"))
    prod.net.crash(prod.triggerer_host.index)
    # A new triggerer, on the scheduler's host: the trigger's state is all in the database and the job's
    # run directory, nothing on the dead machine.
    prod.spawn_on(prod.api_host, "triggerer-2", "triggerer")

    def taken_over():
        ti = prod.task_instance(DEFERRED, run_id, "train")
        return triggerer_of(ti) not in (None, first) and ti

    ti = wait_for(taken_over, timeout=120, interval=1, what="the new triggerer to take the trigger over")
    assert ti["state"] == "deferred" and not (out / "rep").exists()  # the job still runs: it ends once released
    (out / "release").touch()
    run = prod.wait_run(DEFERRED, run_id, timeout=300)
    assert run["state"] == "success", prod.failure_report(DEFERRED, run_id)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert len(events) == 1 and events[0]["status"] == "success", events
    assert prod.task_instance(DEFERRED, run_id, "train")["try_number"] == 1  # resumed, not retried
    assert sorted(os.listdir(out / "rep")) == ["rank0.json", "rank1.json"]  # the job trained to the end
