"""Deferrable mode in real Airflow (dag.test() runs the trigger inline) against the real cluster,
and the trigger on its own: serialization, re-attach after a restart, on_kill."""

from __future__ import annotations

import asyncio
import importlib
import json
import os

import pytest

from dtrain.launch.backends import JobHandle
from dtrain.launch.backends.slurm import SlurmBackend
from dtrain.launch.core.job import prepare_job

from ..conftest import DDP_REPORT, cpu_spec, queue, wait_for


def run_dag(out_dir, fail_rank=-1):
    from tests.conftest import load_test_dag

    dag = load_test_dag("deferrable_dags.py", "slurm_deferrable_test")
    dag_run = dag.test(run_conf={"out_dir": str(out_dir), "fail_rank": fail_rank})
    ti = next(t for t in dag_run.get_task_instances() if t.task_id == "train")
    return ti


def events(out_dir) -> list[dict]:
    path = out_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_deferred_task_succeeds_and_returns_result(airflow_db, slurm, tmp_path):
    ti = run_dag(tmp_path)
    assert ti.state == "success"
    [event] = events(tmp_path)  # execute_complete ran once: the task deferred and the trigger fired
    assert event["status"] == "success" and event["state"] == "COMPLETED" and event["exit_code"] == 0
    job_id = event["handle"]["backend_job_id"]
    assert str(ti.xcom_pull(task_ids="train", key="slurm_job_id")) == job_id
    result = ti.xcom_pull(task_ids="train")
    assert result["exit_code"] == 0 and result["world_size"] == 2 and str(result["slurm_job_id"]) == job_id
    assert sorted(os.listdir(tmp_path / "rep")) == ["rank0.json", "rank1.json"]  # the job really trained
    assert queue(slurm) == []


def test_deferred_task_failure_raises_with_failing_rank_tail(airflow_db, slurm, tmp_path):
    from dtrain.errors import LaunchError
    from dtrain.launch.airflow.deferrable import resume_job
    from dtrain.launch.backends.slurm.render import log_path

    ti = run_dag(tmp_path, fail_rank=1)
    assert ti.state == "failed"
    [event] = events(tmp_path)
    assert event["status"] == "failed" and event["state"] == "FAILED" and event["exit_code"] != 0
    log_lines = open(log_path(event["handle"]["run_dir"], event["handle"]["backend_job_id"])).read().splitlines()
    assert event["tail"] == log_lines[-len(event["tail"]):] and event["tail"]  # the job log's tail
    # What execute_complete raised for that event: the failing rank, its exit code, its last lines.
    with pytest.raises(LaunchError) as info:
        resume_job(None, event)
    assert info.value.exit_code == 7 and info.value.rank == 1
    assert "rank 1: deliberate failure marker" in str(info.value)


def test_job_failing_before_any_rank_raises_with_job_log_tail(slurm, tmp_path):
    """No rank exit record (the interpreter does not exist on the nodes): the job log says why."""
    from dtrain.errors import LaunchError
    from dtrain.launch.airflow.deferrable import resume_job
    from dtrain.launch.airflow.trigger import DistributedJobTrigger

    job, handle = submit_sleeper(tmp_path, 1, python="/nonexistent/python3")
    trigger = DistributedJobTrigger(handle=handle.to_dict(), poll_interval=0.3)

    async def wait_event():
        async for event in trigger.run():
            return event

    event = asyncio.run(asyncio.wait_for(wait_event(), 60)).payload
    assert event["status"] == "failed"
    with pytest.raises(LaunchError) as info:
        resume_job(None, event)
    assert "/nonexistent/python3" in str(info.value) and "last lines of the job log" in str(info.value)
    assert info.value.rank is None and info.value.exit_code != 0


def test_event_not_from_this_submission_is_refused(tmp_path):
    from dtrain.errors import DTrainError
    from dtrain.launch.airflow.deferrable import resume_job

    handle = JobHandle("slurm", "dtrain-x", "999", str(tmp_path), 2, 0.0)
    forged = {"status": "success", "handle": handle.to_dict(), "tail": []}
    with pytest.raises(DTrainError, match="no submission record"):
        resume_job(None, forged)
    with pytest.raises(DTrainError, match="unexpected trigger event"):
        resume_job(None, {"status": "maybe", "handle": handle.to_dict()})
    with pytest.raises(DTrainError, match="not a job handle"):
        resume_job(None, {"status": "success", "handle": {"backend": "slurm", "job_id": "1"}})
    # A record that exists but differs (another run directory's job) is refused too.
    from dtrain.launch.airflow.deferrable import write_submission

    write_submission(JobHandle("slurm", "dtrain-x", "999", str(tmp_path), 4, 0.0))
    with pytest.raises(DTrainError, match="does not match its submission record"):
        resume_job(None, forged)
    with pytest.raises(DTrainError, match="not a mapping"):
        resume_job(None, "success")


def submit_sleeper(tmp_path, seconds, **options):
    spec = cpu_spec(["python", DDP_REPORT, str(tmp_path / "rep"), "--sleep", str(seconds)], nodes=2, procs_per_node=1,
                    run_dir=str(tmp_path / "run"), backend_options=options)
    job = prepare_job(spec)
    from dtrain.launch.airflow.deferrable import write_submission

    handle = SlurmBackend(lambda line: None).submit(job, detached=True)
    write_submission(handle)
    return job, handle


def test_trigger_serializes_primitives_and_reattaches_after_restart(slurm, tmp_path):
    from dtrain.launch.airflow.trigger import DistributedJobTrigger

    job, handle = submit_sleeper(tmp_path, 1)
    job_id = handle.backend_job_id
    first = DistributedJobTrigger(handle=handle.to_dict(), poll_interval=0.3)
    classpath, kwargs = first.serialize()
    assert json.loads(json.dumps(kwargs)) == kwargs  # primitives only
    assert kwargs == {"handle": handle.to_dict(), "poll_interval": 0.3, "hang_timeout": None, "max_poll_interval": None}
    assert kwargs["handle"]["backend"] == "slurm" and kwargs["handle"]["run_dir"] == job.run_dir

    async def first_life():
        # The triggerer runs it for a while, then restarts: the task is cancelled mid-poll.
        gen = first.run()
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(1.0)
        assert not task.done()  # still polling: the job runs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(first_life())
    assert queue(slurm) == [job_id]  # a restart does not cancel the job
    module, _, name = classpath.rpartition(".")
    second = getattr(importlib.import_module(module), name)(**kwargs)  # as the triggerer rebuilds it

    async def second_life():
        async for event in second.run():
            return event

    event = asyncio.run(asyncio.wait_for(second_life(), 90))
    assert event.payload["handle"]["backend_job_id"] == job_id and event.payload["status"] == "success"
    assert any("sleeping" in line for line in event.payload["tail"])


def test_trigger_on_kill_cancels_the_job(slurm, tmp_path):
    from dtrain.launch.airflow.trigger import DistributedJobTrigger

    job, handle = submit_sleeper(tmp_path, 120)
    job_id = handle.backend_job_id
    wait_for(lambda: "RUNNING" in slurm.run(["squeue", "-h", "-j", job_id, "-o", "%T"]).stdout, 30, what="running")
    trigger = DistributedJobTrigger(handle=handle.to_dict(), poll_interval=0.3)
    asyncio.run(trigger.on_kill())

    async def wait_event():
        async for event in trigger.run():
            return event

    event = asyncio.run(asyncio.wait_for(wait_event(), 60))
    assert event.payload["status"] == "failed" and event.payload["state"] == "CANCELLED"
    assert queue(slurm) == []


def test_trigger_gives_up_with_an_error_event_when_slurm_cannot_be_asked(slurm, tmp_path, monkeypatch):
    """A controller that does not answer is retried, then reported as an error (not as a failed job)."""
    from dtrain.launch.airflow.trigger import MAX_POLL_ERRORS, DistributedJobTrigger
    from dtrain.launch.core.job import free_port

    text = open(slurm.conf).read()
    port = [line for line in text.splitlines() if line.startswith("SlurmctldPort=")][0]
    conf = tmp_path / "slurm.conf"
    conf.write_text(text.replace(port, f"SlurmctldPort={free_port()}").replace("MessageTimeout=10", "MessageTimeout=1"))
    monkeypatch.setenv("SLURM_CONF", str(conf))
    trigger = DistributedJobTrigger(handle=JobHandle("slurm", "j", "1", str(tmp_path), 2, 0.0).to_dict(),
                                    poll_interval=0.05)

    async def wait_event():
        async for event in trigger.run():
            return event

    event = asyncio.run(asyncio.wait_for(wait_event(), 60)).payload
    assert event["status"] == "error" and "scontrol show job 1 failed" in event["reason"]
    assert MAX_POLL_ERRORS > 1
