"""Backend.watch, the one way a submitted job is followed (Backend.run after its submit, and a retry
re-attaching through following.Following): how the job's end becomes the outcome, and that everything
but success cancels the whole job. The backend here is a scripted stand-in for infrastructure (named as
such): its poll answers from a list; the lifecycle under test is the real base class's."""

from __future__ import annotations

import json
import os

import pytest

from dtrain.errors import DTrainError, LaunchError
from dtrain.launch.backends.base import Backend, DryRunRequest, JobHandle, JobStatus
from dtrain.launch.backends.base import STUCK_GRACE_S
from dtrain.launch.engine.following import Following


class Scripted(Backend):
    """Polls answer from ``statuses`` in turn; records what the lifecycle called."""

    name = "scripted"

    def __init__(self, statuses):
        self.lines: list[str] = []
        super().__init__(sink=self.lines.append)
        self.statuses, self.calls = list(statuses), []
        self.poll_interval = 0.0

    def dryrun(self, job, *, detached=False):
        return DryRunRequest(backend=self.name, argvs=(("true",),))

    def submit(self, job, *, detached=False):
        self.calls.append("submit")
        return HANDLE

    def poll(self, handle):
        status = self.statuses.pop(0)
        if isinstance(status, BaseException):
            raise status
        return status

    def cancel(self, handle, grace=None):
        self.calls.append(("cancel", grace))

    def logs(self, handle, lines=40):
        return ["last line"]

    def release(self, handle):
        self.calls.append("release")


HANDLE = JobHandle(backend="scripted", job_id="j", backend_job_id="7", run_dir="/nonexistent/j", world_size=2,
                   submitted_at=0.0, data={"poll_interval": 0.01})
RUNNING = JobStatus(state="RUNNING", done=False)


def test_success_is_neither_cancelled_nor_given_a_failure_tail():
    backend = Scripted([RUNNING, JobStatus("COMPLETED", True, 0, tail=["done"])])
    outcome = backend.run(job=None)
    assert (outcome.exit_code, outcome.state, outcome.tail, outcome.stopped) == (0, "COMPLETED", [], False)
    assert backend.calls == ["submit", "release"]


def test_a_failure_without_an_exit_code_is_a_failure_and_stops_the_job():
    """A backend that knows a job failed but not its code (a node lost before it wrote one) used to
    come out of Backend.run with exit code 0: the launcher then reported success."""
    backend = Scripted([JobStatus("NODE_FAIL", True, None, failed_node=1, tail=["lost"])])
    outcome = backend.run(job=None)
    assert (outcome.exit_code, outcome.node_index, outcome.tail, outcome.state) == (1, 1, ["lost"], "NODE_FAIL")
    assert backend.calls == ["submit", ("cancel", None), "release"]


def test_an_error_while_following_cancels_with_the_grace_then_raises():
    backend = Scripted([RUNNING, RuntimeError("boom")])
    with pytest.raises(RuntimeError):
        backend.watch(HANDLE, grace=3.0)
    assert backend.calls == [("cancel", 3.0), "release"]


def test_a_stop_cancels_and_is_reported_as_stopped():
    backend = Scripted([RUNNING] * 5)
    backend.terminate()
    outcome = backend.watch(HANDLE)
    assert outcome.stopped and outcome.exit_code == -1
    assert backend.calls == [("cancel", None), "release"]


def test_re_attaching_follows_with_the_same_watch():
    """following.Following is Backend.watch of the recorded handle: same outcome, state kept for the
    retry policy, the job's last lines when the backend streamed none, LOST when it cannot be asked."""
    backend = Scripted([RUNNING, JobStatus("FAILED", True, 3, failed_node=0, tail=["rank 0 failed"])])
    following = Following(backend, HANDLE)
    outcome = following.run()
    assert (outcome.exit_code, outcome.tail, following.state) == (3, ["rank 0 failed"], "FAILED")
    assert backend.lines == ["last line"] and backend.calls == [("cancel", None), "release"]

    lost = Scripted([DTrainError("controller down")] * 5)
    following = Following(lost, HANDLE)
    with pytest.raises(LaunchError) as err:
        following.run()
    assert following.state == "LOST" and err.value.state == "LOST"
    assert lost.calls == [("cancel", None), "release"]


LOST = {"node": 1, "address": "10.0.0.2", "fault": "unreachable", "detail": "no answer on port 22 within 5 s"}


def test_a_lost_node_stops_the_others_with_the_stuck_grace_not_the_stop_grace():
    """Without the lost node's ranks no other rank can finish a step or agree on a checkpoint: the stop
    grace (30 s by default, for ranks that can save) only delayed the verdict, by 25 s in bench/faults.py
    with a script that saves on SIGTERM. A caller's shorter grace still wins."""
    lost = JobStatus("LOST", True, 255, failed_node=1, tail=["lost"], lost=LOST)
    backend = Scripted([RUNNING, lost])
    outcome = backend.run(job=None)
    assert (outcome.exit_code, outcome.lost) == (255, LOST)
    assert backend.calls == ["submit", ("cancel", STUCK_GRACE_S), "release"]
    backend = Scripted([lost])
    backend.watch(HANDLE, grace=1.0)
    assert backend.calls == [("cancel", 1.0), "release"]
    failed = Scripted([JobStatus("FAILED", True, 3, failed_node=0, tail=["rank 0 failed"])])
    failed.watch(HANDLE)
    assert failed.calls == [("cancel", None), "release"]  # a failed rank's peers may still save: the spec's grace


def test_a_deferred_task_resumed_by_a_lost_node_stops_the_others_with_the_stuck_grace(tmp_path, monkeypatch):
    from dtrain.launch.airflow import deferrable

    handle = JobHandle(backend="scripted", job_id="j", backend_job_id="7", run_dir=str(tmp_path), world_size=2,
                       submitted_at=0.0)
    deferrable.write_submission(handle)
    made: list[Scripted] = []
    monkeypatch.setattr(deferrable, "get_backend_class",
                        lambda name: lambda sink: made.append(Scripted([])) or made[-1])
    event = {"status": "failed", "handle": handle.to_dict(), "state": "LOST", "exit_code": 255, "lost": LOST,
             "tail": ["lost"]}
    with pytest.raises(LaunchError) as err:
        deferrable.resume_job(None, event)
    assert err.value.exit_code == 255 and "node 1 (10.0.0.2) lost: unreachable" in str(err.value)
    assert [b.calls for b in made] == [[("cancel", STUCK_GRACE_S)]]


# -- a stale try's stop leaves the job a later try follows (the follower record) -------------------

def signed_handle(run_dir, secret="ab" * 32) -> JobHandle:
    return JobHandle(backend="scripted", job_id="j", backend_job_id="7", run_dir=str(run_dir), world_size=2,
                     submitted_at=0.0, data={"poll_interval": 0.01, "secret": secret})


def test_the_follower_record_names_the_latest_try_and_only_a_signed_one_counts(tmp_path):
    from dtrain.launch.engine.submission import follower_now, follower_path, taken_over, write_follower

    handle = signed_handle(tmp_path)
    assert follower_now(handle) is None and taken_over(handle, 1) is None  # no record: nobody else follows
    write_follower(handle, 1)
    assert follower_now(handle) == 1 and taken_over(handle, 1) is None
    write_follower(handle, 2)
    assert taken_over(handle, 1) == 2 and taken_over(handle, 2) is None and taken_over(handle, None) is None
    assert taken_over(handle, 3) is None  # an earlier try's record never stops a later try's cancel
    path = follower_path(handle)
    assert "ab" * 32 not in open(path).read()  # the ranks can read the run directory: only a MAC is there
    # The ranks can write it: what they can write without the job's secret is not a follower.

    for forged in ({"follower": 99, "mac": "0" * 64}, {"follower": True, "mac": ""}, {"follower": "9"}, [2], "x"):
        with open(path, "w") as fh:
            json.dump(forged, fh)
        assert follower_now(handle) is None and taken_over(handle, 1) is None, forged
    write_follower(signed_handle(tmp_path, secret="cd" * 32), 5)  # signed with another job's secret
    assert follower_now(handle) is None
    os.remove(path)
    write_follower(handle, 6)
    signed = tmp_path / "signed.json"
    os.rename(path, signed)  # a record this job really signed, moved aside
    os.symlink(signed, path)  # and linked in its place: a link is not followed
    assert follower_now(handle) is None


def test_a_stop_of_a_try_another_try_now_follows_leaves_the_job_running(tmp_path):
    """A try whose worker froze, thawed after the scheduler had failed it and its retry had re-attached:
    Airflow stops it (SIGTERM: the launcher's terminate). Its watch used to cancel the job the retry
    follows (tests/launch/airflow/faults/test_deployment_faults.py, on the Celery deployment)."""
    from dtrain.launch.engine.submission import write_follower

    handle = signed_handle(tmp_path)
    write_follower(handle, 1)
    backend = Scripted([RUNNING] * 5)
    following = Following(backend, handle, follower=1)
    backend.terminate()
    write_follower(handle, 2)  # the retry re-attached meanwhile
    assert following.run().stopped
    assert backend.calls == ["release"]  # no cancel
    assert backend.lines == ["[dtrain] leaving scripted job 7 running: try 2 follows it now"]
    # Still its own job: a stop cancels it, as before.
    backend = Scripted([RUNNING] * 5)
    backend.terminate()
    Following(backend, handle, follower=2).run()
    assert backend.calls == [("cancel", None), "release"]
    # leave(): stop following, the job left to the retry that will re-attach.
    backend = Scripted([RUNNING] * 5)
    following = Following(backend, handle, follower=2)
    following.leave("the task instance is up_for_retry")
    assert following.run().stopped and backend.calls == ["release"]


@pytest.mark.parametrize("state, kept", [
    ("up_for_retry", True), ("queued", True), ("running", True), ("scheduled", True), ("deferred", True),
    (None, True),  # the API server cannot be reached: the stop is the worker's, not a person's
    ("failed", False), ("success", False), ("restarting", False), ("skipped", False), ("removed", False),
])
def test_a_stopped_try_keeps_its_durable_job_only_while_a_try_of_the_task_follows_it(tmp_path, state, kept):
    """A person's stop (marked failed or success, cleared) cancels the job; the scheduler failing the try
    for its retry, or the worker stopping while the task instance runs, leaves it to the try that re-attaches."""
    from dtrain.launch.airflow.resumable import kept_for

    handle = signed_handle(tmp_path)
    why = kept_for(handle, 1, lambda: state)
    assert bool(why) is kept, why
    if kept and state:
        assert why == f"the task instance is {state}: a try of it follows the job or re-attaches to it"


def test_a_later_follower_keeps_the_job_without_asking_airflow(tmp_path):
    from dtrain.launch.airflow.resumable import kept_for
    from dtrain.launch.engine.submission import write_follower

    handle = signed_handle(tmp_path)
    write_follower(handle, 2)
    asked = []
    assert kept_for(handle, 1, lambda: asked.append(1) or "failed") == "try 2 follows it now" and asked == []
    assert kept_for(handle, 2, lambda: "failed") == ""  # its own: the person's stop stops it
