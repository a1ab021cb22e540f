"""Re-attach after a worker crash (durable mode, non-deferrable) on Slurm and over SSH.

In real Airflow (api-server, scheduler with its LocalExecutor, dag-processor, on SQLite), on Slurm
(over SSH: tests/launch/airflow/faults/test_deployment_faults.py, where the worker is a Celery worker on a machine
of its own and the whole machine crashes): the training task's worker -- the LocalExecutor process
and the task process it supervises -- is SIGKILLed mid-training; the scheduler fails that try when
its heartbeats stop, the retry reads the job's handle back from the task state store and follows the
job that is still running.
Exactly one job ran (one Slurm job id / one dtrain job id, one start line per rank), its ranks
all-reduced to the end, and the task succeeded from it on its second try.

In process, with the operator's own mixin methods and a dict standing in for the task state
store: the other branches of the decision (the recorded job already succeeded: its result,
no new job; it failed: what may remain of it is stopped, then a new job; a value that is not
this task's job: never polled nor cancelled, a new job).

The fixtures ``slurm`` (the two-node Slurm cluster) and ``ssh_cluster`` (two sshd hosts) come
from tests/services.py, shared with the other fault tests. Slurm tests share the machine's
test cluster with other sessions: run them under ``flock /tmp/dtrain-slurm-tests.lock``.
"""

from __future__ import annotations

import json
import os

import pytest

from dtrain.launch.backends import JobHandle
from tests.launch.airflow.faults import airflow_fixtures
from tests.launch.airflow.faults.airflow_fixtures import (REPO, RESUMABLE_TRAIN, airflow_running, crash_worker, task_log, tries,
                                           worker_processes)
from tests.remote_jobs import job_processes
from tests.launch.backends.slurm.conftest import queue
from tests.support import wait_for

# The most the job trains. It trains until the test releases it (creates OUT_DIR/release), which
# the test does only once the retry has logged that it re-attached to the still-running job; this
# bound only stops a job nobody released (the test has failed by then).
JOB_SECONDS = 300
KEY = "dtrain_job"  # the operator's external_id_key
# The scheduler fails the crashed try this long after its last heartbeat (the retry starts only
# then). With a beat every second (MIN_HEARTBEAT_INTERVAL below) 15 s is 14 missed beats in a
# row: a slow but live worker on 2 loaded cores is not failed by it, and the retry starts 15 s
# after the crash rather than the fixture's default 30 s.
HEARTBEAT_TIMEOUT_S = 15
MIN_HEARTBEAT_INTERVAL = "1"  # [workers] min_heartbeat_interval: the supervisor's beat (default 5 s)


@pytest.fixture
def fast_heartbeat_timeout(monkeypatch):
    """airflow_running configures the scheduler with airflow_fixtures.HEARTBEAT_TIMEOUT_S."""
    monkeypatch.setattr(airflow_fixtures, "HEARTBEAT_TIMEOUT_S", HEARTBEAT_TIMEOUT_S)


def starts(out_dir) -> list[dict]:
    path = os.path.join(out_dir, "starts.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def ranks_done(out_dir) -> dict[int, dict]:
    out = {}
    for rank in (0, 1):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                out[rank] = json.load(fh)
    return out


def assert_one_job_trained(out_dir, id_field: str) -> str:
    """Exactly one job ran: one start per rank, all with one id; both ranks all-reduced to the end."""
    lines = starts(out_dir)
    assert sorted(s["rank"] for s in lines) == [0, 1], lines
    [job] = {s[id_field] for s in lines}
    done = ranks_done(out_dir)
    assert sorted(done) == [0, 1] and {d["sum"] for d in done.values()} == {3}  # 1 + 2 over both nodes
    assert {d[id_field] for d in done.values()} == {job}
    return job


# -- in real Airflow: SIGKILL the worker mid-training, the retry re-attaches -----------------------

def crash_mid_training_then_retry(services, dag_id: str, conf: dict, out_dir, job_alive,
                                  crash=lambda ti: crash_worker(ti["id"]), run_id: str = "crash-1") -> dict:
    """Trigger, crash the task's worker once every rank trains (``crash(task instance)``; default: SIGKILL
    its processes), check the job outlived it, wait until the retry re-attached to it, check it still
    runs, release it (OUT_DIR/release), wait for the run; returns the task's XCom result and the retry's
    log, after asserting it re-attached."""
    services.trigger(dag_id, run_id, conf)

    def training():
        ti = services.task_instance(dag_id, run_id, "train")
        return ti["state"] == "running" and len(starts(out_dir)) == 2 and worker_processes(ti["id"]) and ti

    ti = wait_for(training, timeout=300, interval=1, what="the task running and both ranks training")
    crash(ti)
    assert job_alive(), "the job died with the worker"
    # The job trains until released: the retry can only have found it running.
    def reattached():
        assert len(starts(out_dir)) == 2, f"the retry started another job: {starts(out_dir)}"
        status, run = services.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}")
        assert status == 200 and run["state"] != "failed", services.failure_report(dag_id, run_id)
        return "Reconnecting to existing job" in task_log(services, dag_id, run_id, "train", 2)

    wait_for(reattached, timeout=JOB_SECONDS - 60, interval=1, what="the retry to re-attach to the running job")
    assert job_alive(), "the job ended before it was released"
    assert len(starts(out_dir)) == 2 and not ranks_done(out_dir)  # still the first job, not done
    (out_dir / "release").touch()
    run = services.wait_run(dag_id, run_id, timeout=JOB_SECONDS + 120)
    assert run["state"] == "success", services.failure_report(dag_id, run_id)
    history = tries(services, dag_id, run_id, "train")
    assert [(t["try_number"], t["state"]) for t in history] == [(1, "failed"), (2, "success")], history
    retry_log = task_log(services, dag_id, run_id, "train", 2)
    # The retry found the job still running and followed it (not "already completed", not a new job).
    assert "Reconnecting to existing job" in retry_log, retry_log[-3000:]
    assert "submitted" not in retry_log.split("Reconnecting to existing job", 1)[1], retry_log[-3000:]
    status, xcom = services.request(
        "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/train/xcomEntries/return_value?deserialize=true")
    assert status == 200, xcom
    value = xcom["value"]
    return (json.loads(value) if isinstance(value, str) else value), retry_log


def test_slurm_worker_crash_retry_reattaches_to_the_running_job(slurm, tmp_path, fast_heartbeat_timeout):
    out = tmp_path / "out"
    env = dict(os.environ, AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL=MIN_HEARTBEAT_INTERVAL)
    with airflow_running(str(tmp_path / "home"), ["fault_reattach_slurm"], env) as services:
        result, retry_log = crash_mid_training_then_retry(
            services, "fault_reattach_slurm", {"out_dir": str(out), "sleep": JOB_SECONDS}, out,
            job_alive=lambda: len(queue(slurm)) == 1)
    slurm_job = assert_one_job_trained(out, "slurm_job")
    assert "rank 0: step 1" in retry_log and "all-reduced sum 3" in retry_log  # the job's output, streamed
    assert result["slurm_job_id"] == slurm_job and result["world_size"] == 2 and result["exit_code"] == 0
    run_dir = result["run_dir"]
    # One sbatch only: one job output file, one submission record in the run directory.
    assert sorted(n for n in os.listdir(run_dir) if n.endswith(".out")) == [f"slurm-{slurm_job}.out"]
    assert sorted(n for n in os.listdir(run_dir) if n.endswith(".submission.json")) == [
        f"slurm-{slurm_job}.submission.json"]


# -- in process: every branch of the re-attach decision --------------------------------------------

class Store(dict):
    """What the mixin uses of Airflow's task state store: get and set."""

    def set(self, key, value, **_):
        self[key] = value


def operator(backend: str, out_dir, run_dir, *extra: str, options: dict | None = None):
    from dtrain.launch.airflow.operator import DistributedTrainingOperator

    return DistributedTrainingOperator(
        task_id="train", backend=backend, nodes=2, procs_per_node=1, device="cpu", workdir=REPO,
        command=[RESUMABLE_TRAIN, str(out_dir), *extra], run_dir=str(run_dir), backend_options=options or {})


def crashed_try(op, context) -> dict:
    """Try 1 up to the crash: the job submitted and recorded, then its worker gone (nothing follows it)."""
    from dtrain.launch.engine.launcher import Launcher

    op._launcher = Launcher(op.build_spec(context), sink=print)
    handle = op.submit_job(context)
    context["task_state_store"].set(KEY, handle)
    return handle


def slurm_options():
    return {"slurm": {"poll_interval": 0.5}}


def ssh_options(cluster):
    return {"ssh": {"hosts": [f"root@{h.line} slots=1" for h in cluster.hosts], **cluster.ssh_settings()}}


def backend_options(backend, request):
    """The operator's backend_options for ``backend``, its fixture started (the Slurm one checks
    the queue is empty before and after the test)."""
    if backend == "slurm":
        request.getfixturevalue("slurm")
        return slurm_options()
    return ssh_options(request.getfixturevalue("ssh_cluster"))


@pytest.mark.parametrize("backend", ["slurm", "ssh"])
def test_retry_follows_a_running_job_then_takes_its_result_when_it_succeeded(backend, request, tmp_path):
    options = backend_options(backend, request)
    out, run_dir = tmp_path / "out", tmp_path / "run"
    context = {"run_id": "r1", "task_state_store": Store()}
    first = crashed_try(operator(backend, out, run_dir, "--sleep", "4", options=options), context)
    wait_for(lambda: len(starts(out)) == 2, 120, what="both ranks started")
    result = operator(backend, out, run_dir, "--sleep", "4", options=options).execute(context)
    job = assert_one_job_trained(out, "slurm_job" if backend == "slurm" else "job")
    assert result[f"{backend}_job_id"] == first["backend_job_id"] and result["exit_code"] == 0
    assert context["task_state_store"][KEY] == first  # followed, not resubmitted
    # A later try (a clear) finds it succeeded: its result, without a new job.
    again = operator(backend, out, run_dir, "--sleep", "4", options=options).execute(context)
    assert again[f"{backend}_job_id"] == first["backend_job_id"] and again["state"] == result["state"]
    assert len(starts(out)) == 2 and assert_one_job_trained(out, "slurm_job" if backend == "slurm" else "job") == job


@pytest.mark.parametrize("backend", ["slurm", "ssh"])
def test_retry_after_a_failed_job_stops_its_leftovers_and_submits_again(backend, request, tmp_path):
    options = backend_options(backend, request)
    out, run_dir = tmp_path / "out", tmp_path / "run"
    context = {"run_id": "r1", "task_state_store": Store()}
    args = ("--fail-once", "RuntimeError: deliberate", "--sleep", "3")
    op = operator(backend, out, run_dir, *args, options=options)
    first = crashed_try(op, context)
    handle = JobHandle.from_dict(first)
    # The job fails while no worker follows it (with SSH, node 1 then waits for its dead peer).
    wait_for(lambda: op._launcher.backend.poll(handle).done, 120, what="the first job to be reported failed")
    result = operator(backend, out, run_dir, *args, options=options).execute(context)
    second = context["task_state_store"][KEY]
    assert second["backend_job_id"] != first["backend_job_id"]
    assert result[f"{backend}_job_id"] == second["backend_job_id"]
    ids = [s["slurm_job" if backend == "slurm" else "job"] for s in starts(out)]
    assert len(ids) == 4 and len(set(ids)) == 2  # the failed job's two ranks, then the new job's two
    assert not job_processes(first["job_id"])  # nothing of the failed job was left running


def test_a_recorded_value_that_is_not_this_tasks_job_is_left_alone(slurm, tmp_path, monkeypatch):
    from dtrain.launch.backends.slurm import SlurmBackend
    from dtrain.launch.engine.launcher import Launcher

    touched = []
    for name in ("poll", "cancel"):
        real = getattr(SlurmBackend, name)
        monkeypatch.setattr(SlurmBackend, name, lambda self, handle, *a, _real=real, _name=name, **k: (
            touched.append((_name, handle.backend_job_id)), _real(self, handle, *a, **k))[1])
    out, run_dir = tmp_path / "out", tmp_path / "run"
    other = {"backend": "slurm", "job_id": "dtrain-other", "backend_job_id": "999999", "run_dir": str(tmp_path / "x"),
             "world_size": 2, "submitted_at": 0.0, "data": {}}
    context = {"run_id": "r1", "task_state_store": Store({KEY: other})}
    result = operator("slurm", out, run_dir, options=slurm_options()).execute(context)
    assert result["exit_code"] == 0 and not [t for t in touched if t[1] == "999999"]
    assert context["task_state_store"][KEY]["backend_job_id"] == result["slurm_job_id"]
    # A handle edited to name another job in this task's own run directory has no submission record there.
    forged = dict(context["task_state_store"][KEY], backend_job_id="999998")
    op = operator("slurm", out, run_dir, options=slurm_options())
    op._launcher = Launcher(op.build_spec(context))
    assert op.get_job_status(forged, context) == "not-ours:"
    assert not [t for t in touched if t[1] in ("999999", "999998")]


@pytest.mark.parametrize("backend", ["slurm", "ssh"])
def test_on_kill_stops_the_detached_job_of_a_durable_task(backend, request, tmp_path):
    """Marking the task failed (SIGTERM to the task process: on_kill) still stops the job, which
    now runs detached from the worker."""
    import threading

    from dtrain.errors import LaunchError

    options = slurm_options() if backend == "slurm" else ssh_options(request.getfixturevalue("ssh_cluster"))
    cluster = request.getfixturevalue("slurm") if backend == "slurm" else None
    out = tmp_path / "out"
    op = operator(backend, out, tmp_path / "run", "--sleep", "300", options=options)
    errors = []

    def execute():
        try:
            op.execute({"run_id": "r1", "task_state_store": Store()})
        except LaunchError as e:
            errors.append(e)

    thread = threading.Thread(target=execute)
    thread.start()
    wait_for(lambda: len(starts(out)) == 2, 120, what="both ranks training")
    job_id = starts(out)[0]["job"]
    op.on_kill()
    thread.join(timeout=120)
    assert not thread.is_alive() and len(errors) == 1 and errors[0].exit_code == 143
    assert wait_for(lambda: not job_processes(job_id), 60, what="every process of the job to end")
    if cluster is not None:
        assert wait_for(lambda: queue(cluster) == [], 60, what="the Slurm job to leave the queue")
