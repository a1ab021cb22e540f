"""Deferrable mode over SSH, against real sshd hosts on loopback (``ssh_cluster``, tests/services.py):
the operator starts one detached agent per host and defers (raising Airflow's real
TaskDeferred); the trigger, rebuilt from its serialized kwargs as a triggerer would,
polls the hosts over ssh; execute_complete returns the result or raises with the tail,
stopping the nodes still running; on_kill stops every host's node.

Hostile ranks (issue #22; tests/launch/backends/ssh/remote/forge_detached.py): forged exit records neither end
the watch nor break it; node logs swapped for links are not read into the event; the job's
secret reaches neither the ranks, nor the run directory, nor the event; a watch that fails
in a way nobody planned for cancels the job and reports an error."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys

import psutil
import pytest

from dtrain.launch.backends import JobHandle
from dtrain.launch.core.spec import LaunchSpec

from tests.launch.backends.slurm.conftest import DDP_REPORT, REPO, wait_for


def ssh_spec(cluster, tmp_path, *args, procs=2):
    return LaunchSpec(command=["python", DDP_REPORT, str(tmp_path / "rep"), *args], nodes=2, procs_per_node=procs,
                      backend="ssh", backend_options={"hosts": [f"root@{h.line} slots={procs}" for h in cluster.hosts],
                                                      **cluster.ssh_settings()}, device="cpu", workdir=REPO, run_dir=str(tmp_path / "run"))


def process_name(proc: psutil.Process) -> str | None:
    """Its name, or None once it is gone (a child can exit between listing and asking)."""
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return None


def job_pids(job_id: str) -> set[int]:
    """Every live process of the job on every "host" (they all run on this machine)."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != os.getpid() and (job_id in " ".join(proc.info["cmdline"] or ())
                                            or proc.environ().get("DTRAIN_JOB_ID") == job_id):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def defer(spec):
    """Run the operator's execute up to its deferral; return the operator and the trigger."""
    from airflow.sdk.exceptions import TaskDeferred

    from dtrain.launch.airflow.deferrable import defer_job
    from dtrain.launch.airflow.operator import DistributedTrainingOperator

    op = DistributedTrainingOperator(task_id="train", command=spec.command, backend="ssh", deferrable=True)
    with pytest.raises(TaskDeferred) as info:
        defer_job(op, spec, context={})
    assert info.value.method_name == "execute_complete"
    return op, info.value.trigger


def rebuilt(trigger):
    classpath, kwargs = trigger.serialize()
    assert json.loads(json.dumps(kwargs)) == kwargs  # primitives only (hosts as lines, settings as a dict)
    module, _, name = classpath.rpartition(".")
    return getattr(importlib.import_module(module), name)(**kwargs)


def first_event(trigger, timeout=120):
    async def wait():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(asyncio.wait_for(wait(), timeout))


def test_ssh_deferred_task_in_airflow_dag_test(airflow_db, ssh_cluster, tmp_path, monkeypatch):
    """The same through Airflow's dag.test(): deferred, trigger run inline, resumed, succeeded."""
    from tests.conftest import load_test_dag

    monkeypatch.setenv("DTRAIN_TEST_SSH_KEY", ssh_cluster.key_file)
    monkeypatch.setenv("DTRAIN_TEST_SSH_KNOWN_HOSTS", ssh_cluster.known_hosts)
    dag = load_test_dag("deferrable_dags.py", "ssh_deferrable_test")
    dag_run = dag.test(run_conf={"out_dir": str(tmp_path), "hostfile": ssh_cluster.hostfile(1)})
    ti = next(t for t in dag_run.get_task_instances() if t.task_id == "train")
    assert ti.state == "success"
    [event] = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["status"] == "success" and event["handle"]["backend"] == "ssh"  # it deferred, the trigger fired
    job_id = event["handle"]["backend_job_id"]
    result = ti.xcom_pull(task_ids="train")
    assert result["world_size"] == 2 and result["ssh_job_id"] == job_id
    reps = [json.load(open(tmp_path / "rep" / name)) for name in sorted(os.listdir(tmp_path / "rep"))]
    assert [(r["RANK"], r["NODE_RANK"]) for r in reps] == [("0", "0"), ("1", "1")]  # node rank in host order
    assert len({(r["weight"], r["bias"]) for r in reps}) == 1  # all-reduced across the two hosts
    wait_for(lambda: not job_pids(job_id), 10, what="the detached nodes to exit")


def test_ssh_deferred_failure_stops_the_other_host_and_raises_with_tail(ssh_cluster, tmp_path):
    from dtrain.errors import LaunchError

    spec = ssh_spec(ssh_cluster, tmp_path, "--fail-rank", "1", procs=1)
    op, trigger = defer(spec)
    job_id = op._dtrain_submission["job_id"]
    # The task holds nothing while deferred: no ssh client of ours; the nodes run detached.
    assert not [p for p in psutil.Process().children(recursive=True) if process_name(p) == "ssh"]
    event = first_event(rebuilt(trigger))
    assert event["status"] == "failed" and event["exit_code"] != 0
    with pytest.raises(LaunchError) as info:
        op.execute_complete({}, event)
    assert info.value.rank == 1 and info.value.exit_code == 7
    assert "rank 1: deliberate failure marker" in str(info.value)
    assert job_pids(job_id) == set()  # node 0, perhaps still waiting for rank 1, was stopped


def test_ssh_trigger_on_kill_stops_every_host(ssh_cluster, tmp_path):
    spec = ssh_spec(ssh_cluster, tmp_path, "--sleep", "120", procs=1)
    op, trigger = defer(spec)
    job_id = op._dtrain_submission["job_id"]
    run_dir = spec.run_dir
    wait_for(lambda: all(os.path.exists(os.path.join(run_dir, "detached", f"node{i}.state.json")) for i in (0, 1)),
             30, what="both nodes started")
    wait_for(lambda: len(job_pids(job_id)) >= 6, 60, what="agents and ranks up")  # daemon, torchrun, rank x2
    pids = job_pids(job_id)
    asyncio.run(rebuilt(trigger).on_kill())
    gone = wait_for(lambda: not (pids & job_pids(job_id)), 30, what="every process of the job to end")
    assert gone
    for i in (0, 1):
        record = json.load(open(os.path.join(run_dir, "detached", f"node{i}.exit.json")))
        assert record["stopped_by_signal"] == 15
    event = first_event(rebuilt(trigger), 30)
    assert event["status"] == "failed"


FORGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forge_detached.py")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def one_rank_per_host(cluster, tmp_path, command):
    return LaunchSpec(command=command, nodes=2, procs_per_node=1, backend="ssh", device="cpu", stop_grace=2,
                      backend_options={"hosts": [f"root@{h.line} slots=1" for h in cluster.hosts],
                                       **cluster.ssh_settings()}, workdir=REPO, run_dir=str(tmp_path / "run"))


@pytest.fixture
def deferred():
    """defer(), with every deferred job stopped at teardown (pass or fail)."""
    from dtrain.launch.backends.ssh import SSHBackend

    handles: list[JobHandle] = []

    def defer_spec(spec):
        op, trigger = defer(spec)
        handles.append(trigger.handle)  # the full handle, as the trigger's kwargs hold it
        return op, trigger

    yield defer_spec
    for handle in handles:
        SSHBackend(sink=lambda line: None).cancel(handle, grace=1)
        for pid in job_pids(handle.job_id):
            psutil.Process(pid).kill()


class Recorded:
    """Keeps what the trigger logs (the backend's sink is the trigger's log)."""

    def __init__(self):
        self.lines: list[str] = []

    def _keep(self, message, *args, **_):
        self.lines.append(str(message) % args if args else str(message))

    info = warning = error = exception = debug = _keep


def watched(trigger) -> Recorded:
    trigger._log = Recorded()
    return trigger._log


def forged(run_dir: str) -> bool:
    return all(os.path.exists(os.path.join(run_dir, f"forged-{rank}")) for rank in (0, 1))


@pytest.mark.parametrize("value", ["0", '"x"', "1e999", "[1]"])
def test_forged_exit_records_neither_end_the_watch_nor_break_it(ssh_cluster, tmp_path, deferred, value):
    """A rank writes {"exit_code": VALUE} as both nodes' exit records while the job runs: the
    trigger reports the records it ignored and keeps watching (no success, no exception); once
    the job is really stopped, the daemons' own records end the watch."""
    from dtrain.launch.backends.ssh import SSHBackend

    spec = one_rank_per_host(ssh_cluster, tmp_path, [sys.executable, FORGE, "exit", value])
    _, trigger = deferred(spec)
    wait_for(lambda: forged(spec.run_dir), 60, what="the forged exit records")
    trigger = rebuilt(trigger)
    log = watched(trigger)

    async def scenario():
        watch = asyncio.ensure_future(trigger.run().__anext__())
        while not watch.done() and not any("ignored detached/node1.exit.json" in line for line in log.lines):
            await asyncio.sleep(0.1)
        assert not watch.done(), watch.result()  # the old code: a success event, or ValueError & co. out of run()
        await asyncio.to_thread(SSHBackend(sink=lambda line: None).cancel, trigger.handle)
        return (await watch).payload

    event = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert (event["status"], event["state"]) == ("failed", "FAILED"), event
    assert "node 0: ignored detached/node0.exit.json: not signed" in "\n".join(log.lines)


def test_node_logs_swapped_for_links_are_not_read_into_the_event(ssh_cluster, tmp_path, deferred):
    from dtrain.errors import LaunchError
    from dtrain.launch.backends.ssh import SSHBackend

    credentials = tmp_path / "credentials"
    credentials.write_text("aws_secret_access_key = AKIA-NOT-FOR-LOGS\n")
    spec = one_rank_per_host(ssh_cluster, tmp_path, [sys.executable, FORGE, "link", str(credentials)])
    op, trigger = deferred(spec)
    event = first_event(rebuilt(trigger))
    assert event["status"] == "failed" and forged(spec.run_dir), event
    assert "AKIA" not in json.dumps(event)  # the old reader followed the link into the event's tail
    assert not [line for line in SSHBackend(sink=lambda line: None).logs(trigger.handle) if "AKIA" in line]
    with pytest.raises(LaunchError) as info:
        op.execute_complete({}, event)
    assert info.value.exit_code == 3 and "AKIA" not in str(info.value)


def test_the_job_secret_reaches_neither_the_ranks_nor_the_run_directory_nor_the_event(ssh_cluster, tmp_path,
                                                                                       deferred):
    from dtrain.launch.node.proctree import environ_of

    spec = one_rank_per_host(ssh_cluster, tmp_path, SLEEPER)
    _, trigger = deferred(spec)
    job_id, secret = trigger.handle.job_id, trigger.handle.data["secret"]
    wait_for(lambda: len(job_pids(job_id)) >= 6, 60, what="daemons, agents and ranks up")  # on each host: 3
    for pid in job_pids(job_id):  # the daemons, torchrun, the ranks: argv and environment
        try:
            argv = psutil.Process(pid).cmdline()
        except psutil.NoSuchProcess:
            continue
        assert secret not in json.dumps([argv, environ_of(pid)]), argv
    for folder, _, files in os.walk(spec.run_dir):  # what the ranks can read (the submission record too)
        for name in files:
            with open(os.path.join(folder, name), "rb") as fh:
                assert secret.encode() not in fh.read(), name
    with open(os.path.join(spec.run_dir, "detached", "node0.state.json"), encoding="utf-8") as fh:
        daemon = json.load(fh)["pid"]
    assert environ_of(daemon)["DTRAIN_JOB_ID"] == job_id  # what a stop checks before it signals the daemon
    assert secret not in repr(rebuilt(trigger)) and secret not in repr(trigger.handle)  # Airflow logs both
    assert secret in json.dumps(trigger.serialize()[1])  # only in the kwargs (kept encrypted by Airflow)
    asyncio.run(rebuilt(trigger).on_kill())
    event = first_event(rebuilt(trigger), 60)
    assert event["status"] == "failed" and secret not in json.dumps(event)  # the triggerer logs its events


def test_a_watch_failing_unexpectedly_cancels_the_job_and_reports_an_error(ssh_cluster, tmp_path, deferred,
                                                                           monkeypatch):
    """No input makes a poll raise anything but "cannot ask" any more; a bug still could. The poll is
    made to raise (the fault injected); the trigger and the cancel over ssh are the real ones."""
    from dtrain.launch.backends.ssh import SSHBackend

    spec = one_rank_per_host(ssh_cluster, tmp_path, SLEEPER)
    _, trigger = deferred(spec)
    job_id = trigger.handle.job_id
    pids = wait_for(lambda: len(found := job_pids(job_id)) >= 6 and found, 60, what="the job up")

    async def broken(self, handle):
        raise RuntimeError("a bug in the poll")

    monkeypatch.setattr(SSHBackend, "async_poll", broken)
    event = first_event(rebuilt(trigger), 60)
    assert event["status"] == "error" and "RuntimeError: a bug in the poll" in event["reason"], event
    assert wait_for(lambda: not (pids & job_pids(job_id)), 30, what="the job cancelled")  # not left unwatched
