"""The retry policy: which failures a retry can fix (dtrain.launch.engine.retry, a pure function compared
exactly), its Airflow adapter, and in real Airflow (dag.test() on SQLite, the task runner that
evaluates the policy): bad input fails once with retries=2, a communication error is retried."""

from __future__ import annotations

import json
import os

import pytest

from dtrain.errors import DTrainError, LaunchError, SpecError
from dtrain.launch.core.exits import communication_error
from dtrain.launch.engine.retry import DEFAULT, FAIL, RETRY, Verdict, classify, classify_launch

GLOO = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
        "Gloo connectFullMesh failed with Connection reset by peer")


@pytest.mark.parametrize("error, expected", [
    (SpecError("nodes", "zero", "an integer >= 1"),
     Verdict(FAIL, "bad input, a retry would fail the same way: nodes='zero' is invalid: an integer >= 1")),
    (SpecError("deepspeed_config.train_batch_size", 3, "must equal 2 x 1 x 2 = 4"),
     Verdict(FAIL, "bad input, a retry would fail the same way: deepspeed_config.train_batch_size=3 is invalid: "
                   "must equal 2 x 1 x 2 = 4")),
    (LaunchError("job j was stopped", 143),
     Verdict(RETRY, "transient: preempted, the job was stopped by SIGTERM (exit 143)")),
    (LaunchError("slurm job 7 ended PREEMPTED", 1, state="PREEMPTED"),
     Verdict(RETRY, "transient: preempted, the job was stopped by SIGTERM (exit 1, state PREEMPTED)")),
    (LaunchError("ssh to h failed", 255),
     Verdict(RETRY, "transient: a node or its connection was lost (exit 255)")),
    (LaunchError("slurm job 7 ended NODE_FAIL", 1, state="NODE_FAIL"),
     Verdict(RETRY, "transient: a node or its connection was lost (exit 1, state NODE_FAIL)")),
    (LaunchError("lost track of ssh job j", 1, state="LOST"),
     Verdict(RETRY, "transient: a node or its connection was lost (exit 1, state LOST)")),
    (LaunchError("job j failed: rank 1 exited with 1", 1, 1, ["step 3", GLOO, "exiting"]),
     Verdict(RETRY, f"transient: communication error between ranks: {GLOO[:200]}")),
    (LaunchError("job j failed", 1, 0, ["torch.distributed.DistBackendError: NCCL error in: ..."]),
     Verdict(RETRY, "transient: communication error between ranks: "
                    "torch.distributed.DistBackendError: NCCL error in: ...")),
    (LaunchError("job j hung", 124, 1),
     Verdict(RETRY, "transient: the job hung (no progress) and was torn down (exit 124); "
                    "a retry resumes from its checkpoint")),
    (LaunchError("slurm job 7 ended TIMEOUT", 124, state="TIMEOUT"),
     Verdict(RETRY, "transient: the job hit its time limit (exit 124); a retry resumes from its checkpoint")),
    (LaunchError("slurm job 7 ended CANCELLED", 143, state="CANCELLED"),
     Verdict(DEFAULT, "cancelled (state CANCELLED)")),
    (LaunchError("job j failed: rank 0 exited with 1", 1, 0, ["ValueError: a bug"]),
     Verdict(DEFAULT, "no transient cause recognised (exit 1)")),
    (LaunchError("killed", 137, state="OUT_OF_MEMORY"),
     Verdict(DEFAULT, "no transient cause recognised (exit 137, state OUT_OF_MEMORY)")),
    (DTrainError("unexpected trigger event"), Verdict(DEFAULT, "DTrainError: not a launch failure")),
    (KeyError("x"), Verdict(DEFAULT, "KeyError: not a launch failure")),
])
def test_classify(error, expected):
    assert classify(error) == expected


def test_a_spec_error_given_as_the_cause_is_still_bad_input():
    try:
        try:
            raise SpecError("nodes", 0, "an integer >= 1")
        except SpecError as e:
            raise RuntimeError("while rendering") from e
    except RuntimeError as wrapped:
        assert classify(wrapped).action == FAIL
    # An exception merely raised while handling another (implicit context) is judged on its own.
    try:
        try:
            raise SpecError("nodes", 0, "an integer >= 1")
        except SpecError:
            raise KeyError("x")
    except KeyError as unrelated:
        assert classify(unrelated).action == DEFAULT


def test_communication_error_reads_only_the_last_lines_and_cuts_long_ones():
    assert communication_error([GLOO] + ["ok"] * 40) is None  # older than the tail the launcher keeps
    assert communication_error(["x" * 5000 + "NCCL error"]) is None  # past the cut: never scanned
    assert communication_error(["a", "NCCL error: unhandled system error", "b"]) == "NCCL error: unhandled system error"
    assert classify_launch(1, None, ["ProcessGroupGloo::allreduce failed"]) == Verdict(
        RETRY, "transient: communication error between ranks: ProcessGroupGloo::allreduce failed")


def test_launch_error_keeps_its_fields_across_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(LaunchError("job j failed", 1, 2, ["a", "b"], "NODE_FAIL")))
    assert (error.exit_code, error.rank, error.tail, error.state) == (1, 2, ["a", "b"], "NODE_FAIL")
    assert str(error) == "job j failed\nlast lines of rank 2:\na\nb"


def test_the_airflow_policy_maps_verdicts_to_decisions():
    from airflow.sdk import RetryAction

    from dtrain.launch.airflow.operator import DistributedTrainingOperator
    from dtrain.launch.airflow.retry_policy import TrainingRetryPolicy

    policy = TrainingRetryPolicy()
    fail = policy.evaluate(SpecError("nodes", 0, "an integer >= 1"), 1, 3)
    assert (fail.action, fail.reason) == (RetryAction.FAIL, classify(SpecError("nodes", 0, "an integer >= 1")).reason)
    retry = policy.evaluate(LaunchError("stopped", 143), 1, 3)
    assert (retry.action, retry.retry_delay, retry.reason) == (
        RetryAction.RETRY, None, "transient: preempted, the job was stopped by SIGTERM (exit 143)")
    assert policy.evaluate(ValueError("x"), 1, 3).action == RetryAction.DEFAULT
    assert TrainingRetryPolicy.deserialize(policy.serialize()) == policy
    # The operator's default; a DAG author's own policy (or None) wins.
    assert DistributedTrainingOperator(task_id="t", command=["x.py"]).retry_policy == policy
    assert DistributedTrainingOperator(task_id="u", command=["x.py"], retry_policy=None).retry_policy is None


# -- in real Airflow -------------------------------------------------------------------------------

def _tries(dag_run, task_id):
    """(try_number, state, retry_reason) of every try of the task, the earlier ones from history."""
    from sqlalchemy import select

    from airflow.models.taskinstancehistory import TaskInstanceHistory
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.execute(select(TaskInstanceHistory).where(
            TaskInstanceHistory.dag_id == dag_run.dag_id, TaskInstanceHistory.run_id == dag_run.run_id,
            TaskInstanceHistory.task_id == task_id)).scalars().all()
        history = [(h.try_number, str(h.state), h.retry_reason) for h in rows]
    ti = next(t for t in dag_run.get_task_instances() if t.task_id == task_id)
    return sorted(history) + [(ti.try_number, str(ti.state), ti.retry_reason)]


def test_bad_input_fails_once_without_retrying(airflow_db, tmp_path):
    from tests.conftest import load_test_dag

    dag = load_test_dag("fault_dags.py", "fault_bad_input")
    assert all(task.retries == 2 for task in dag.tasks)
    dag_run = dag.test(run_conf={"out_dir": str(tmp_path), "nodes": "zero"})
    assert _tries(dag_run, "bad_nodes") == [(1, "failed", None)]
    assert _tries(dag_run, "bad_deepspeed_config") == [(1, "failed", None)]
    assert os.listdir(tmp_path) == []  # nothing was launched


def test_a_communication_error_is_retried_and_the_retry_succeeds(airflow_db, tmp_path):
    from tests.conftest import load_test_dag

    dag = load_test_dag("fault_dags.py", "fault_transient")
    dag_run = dag.test(run_conf={"out_dir": str(tmp_path)})
    comm = _tries(dag_run, "communication_error")
    # (the history keeps an earlier try as "failed"; it was retried, as try 2 shows)
    assert [(n, state) for n, state, _ in comm] == [(1, "failed"), (2, "success")]
    assert comm[0][2].startswith("transient: communication error between ranks: RuntimeError: ")
    assert "Gloo connectFullMesh failed" in comm[0][2]
    # A bug in the script is no transient fault: the task's own retries decide (no policy reason).
    bug = _tries(dag_run, "script_bug")
    assert bug == [(1, "failed", None), (2, "success", None)]
    for folder in ("comm", "bug"):  # one failed start, then one full run
        starts = [json.loads(line) for line in (tmp_path / folder / "starts.jsonl").read_text().splitlines()]
        assert len(starts) == 2 and len({s["job"] for s in starts}) == 2
        assert json.loads((tmp_path / folder / "rank0.json").read_text())["sum"] == 1


def test_a_hung_event_from_the_trigger_raises_a_retryable_launch_error(tmp_path, monkeypatch):
    """Deferrable mode: the trigger's ``hung`` event (it cancelled the job) resumes the task with
    LaunchError(124, state HUNG): retried, like a hang the launcher caught."""
    from dtrain.launch.airflow.deferrable import resume_job, write_submission
    from dtrain.launch.backends import JobHandle
    from dtrain.launch.backends.ssh import SSHBackend

    cancelled = []
    monkeypatch.setattr(SSHBackend, "cancel", lambda self, handle, *a, **k: cancelled.append(handle.job_id))
    handle = JobHandle(backend="ssh", job_id="dtrain-h", backend_job_id="dtrain-h", run_dir=str(tmp_path),
                       world_size=2, submitted_at=0.0, data={"hosts": ["127.0.0.1"], "ssh": {}, "detached": True})
    write_submission(handle)
    event = {"status": "hung", "handle": handle.to_dict(), "state": "HUNG", "exit_code": 124, "failed_node": None,
             "reason": "hang detected: rank(s) 1 stuck", "tail": [], "hang": {"stuck_ranks": [1]}}
    with pytest.raises(LaunchError) as info:
        resume_job(None, event)
    error = info.value
    assert (error.exit_code, error.rank, error.state) == (124, 1, "HUNG") and cancelled == ["dtrain-h"]
    assert str(error) == "ssh job dtrain-h hang detected: rank(s) 1 stuck"
    assert classify(error) == Verdict(RETRY, "transient: the job hung (no progress) and was torn down (exit 124); "
                                             "a retry resumes from its checkpoint")
