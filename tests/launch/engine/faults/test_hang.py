"""Hang detection (dtrain.launch.engine.hang): a rank goes silent while its peers block in all_reduce.

End to end on the local backend (1x2, with and without the training helper) and on two sshd
"hosts" (2x2): the launch exits 124, names the silent rank, every rank's stack is on disk,
and no process is left (the autouse fixture in tests/conftest.py checks the job's processes).
The diagnosis itself is pure and tested by exact comparison.
"""

from __future__ import annotations

import json
import os
import time
import subprocess
import sys

import pytest

from dtrain.errors import SpecError
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine import hang
from dtrain.launch.node import hang_files

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
HANG_TRAIN = os.path.join(REPO, "tests", "launch", "scripts", "hang_train.py")
TIMEOUT = 8.0
# The bound: detected within hang_timeout + 30 s of the rank going silent.
DETECTION_BOUND = TIMEOUT + 30


def launch_cli(run_dir, *args, script_args=(), timeout=180) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "dtrain.cli", "launch", "--device", "cpu", "--run-dir", str(run_dir), *args,
            "--", "python", HANG_TRAIN, *script_args]
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def read_json(path):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def went_silent_at(run_dir) -> float:
    with open(os.path.join(run_dir, "went_silent"), encoding="utf-8") as fh:
        return float(fh.read())


def assert_hang_reported(run, run_dir, world_size, stuck):
    assert run.returncode == hang.HANG_EXIT_CODE, run.stdout[-3000:] + run.stderr[-3000:]
    verdict = read_json(os.path.join(run_dir, "hang", "verdict.json"))
    assert verdict["stuck_ranks"] == stuck
    assert verdict["missing_stacks"] == []
    assert sorted(verdict["stacks"], key=int) == [str(r) for r in range(world_size)]
    stacks = [os.path.join(run_dir, "hang", f"rank{r}.txt") for r in range(world_size)]
    assert all(os.path.getsize(path) > 0 for path in stacks)
    message = f"rank(s) {', '.join(map(str, stuck))} stuck"
    assert message in run.stderr and all(path in run.stderr for path in stacks)
    latency = verdict["detected_at"] - went_silent_at(run_dir)
    assert TIMEOUT <= latency + 1.5 and latency <= DETECTION_BOUND, latency
    return verdict, {r: open(p, encoding="utf-8").read() for r, p in enumerate(stacks)}


def test_local_silent_rank_is_named_from_the_flight_recorder_and_every_stack_dumped(tmp_path):
    run = launch_cli(tmp_path, "--procs-per-node", "2", "--hang-timeout", str(TIMEOUT),
                     script_args=["--silent-rank", "1", "--silent-step", "5"])
    verdict, stacks = assert_hang_reported(run, str(tmp_path), 2, stuck=[1])
    assert verdict["reason"] == "never entered collective #5 (gloo:all_reduce) that rank(s) 0 wait in"
    assert "in go_silent" in hang.main_thread_stack(stacks[1])
    assert "in all_reduce" in hang.main_thread_stack(stacks[0])
    assert sorted(verdict["flight_recorder"]) == ["0", "1"]


def test_local_script_without_the_helper_is_dumped_by_py_spy(tmp_path):
    run = launch_cli(tmp_path, "--procs-per-node", "2", "--hang-timeout", str(TIMEOUT),
                     script_args=["--silent-rank", "0", "--silent-step", "4", "--no-helper"])
    verdict, stacks = assert_hang_reported(run, str(tmp_path), 2, stuck=[0])
    assert verdict["reason"] == "not in a collective, while rank(s) 1 wait in one"
    assert "py-spy dump" in stacks[0] and "go_silent (hang_train.py" in stacks[0]
    assert "all_reduce (torch/distributed/distributed_c10d.py" in stacks[1] or "all_reduce (" in stacks[1]


@pytest.mark.parametrize("beat", [True, False], ids=["heartbeat", "no-heartbeat"])
def test_heartbeat_is_progress(tmp_path, beat):
    """Every rank works quietly for three timeouts; with heartbeat() that is progress, without it a hang."""
    args = ["--silent-step", "0", "--quiet-step", "3", "--quiet-seconds", "12", "--steps", "6"]
    run = launch_cli(tmp_path, "--procs-per-node", "2", "--hang-timeout", "4",
                     script_args=args + (["--heartbeat"] if beat else []))
    if beat:
        assert run.returncode == 0, run.stderr[-3000:]
        assert not os.path.exists(os.path.join(tmp_path, "hang", "verdict.json"))
    else:
        assert run.returncode == hang.HANG_EXIT_CODE, run.stderr[-3000:]
        verdict = read_json(os.path.join(tmp_path, "hang", "verdict.json"))
        assert verdict["stuck_ranks"] == [0, 1] and verdict["reason"] == "no rank made progress"


def test_a_slow_start_up_is_not_a_hang(tmp_path):
    """Ranks silent for four hang timeouts before their first line (a slow import) are starting, not hung.
    Fails on 74d7975: the wrapper's start counted as progress, and the job was stopped as hung."""
    run = launch_cli(tmp_path, "--procs-per-node", "2", "--hang-timeout", "3",
                     script_args=["--silent-step", "0", "--steps", "3", "--start-seconds", "12"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert not os.path.exists(os.path.join(tmp_path, "hang", "verdict.json"))
    assert sorted(os.listdir(os.path.join(tmp_path, "progress"))) == ["rank0", "rank0.started", "rank1", "rank1.started"]


def test_ssh_two_hosts_silent_rank_on_the_second_host(ssh_cluster, tmp_path):
    from dtrain.launch.engine.launcher import Launcher

    lines: list[str] = []
    spec = LaunchSpec(command=["python", HANG_TRAIN, "--silent-rank", "3", "--silent-step", "4"], nodes=2,
                      procs_per_node=2, backend="ssh", device="cpu", run_dir=str(tmp_path), hang_timeout=TIMEOUT,
                      env={"GLOO_SOCKET_IFNAME": "lo"}, workdir=REPO,
                      backend_options={"hostfile": ssh_cluster.hostfile(2), **ssh_cluster.ssh_settings()})
    result = Launcher(spec, sink=lines.append).run()
    assert result.exit_code == hang.HANG_EXIT_CODE and result.hang["stuck_ranks"] == [3], lines[-30:]
    assert result.hang["reason"] == "never entered collective #4 (gloo:all_reduce) that rank(s) 0, 1, 2 wait in"
    assert result.hang["missing_stacks"] == [] and sorted(result.hang["stacks"]) == ["0", "1", "2", "3"]
    assert result.hang["detected_at"] - went_silent_at(str(tmp_path)) <= DETECTION_BOUND
    with pytest.raises(Exception) as failure:
        result.raise_for_status()
    assert "rank(s) 3 stuck" in str(failure.value) and result.hang["stacks"]["3"] in str(failure.value)
    assert any("hang detected" in line for line in lines)


# -- the pure parts -----------------------------------------------------------------------------

def fr(*entries):
    return {"entries": [dict({"pg_id": 0, "is_p2p": False, "profiling_name": "gloo:all_reduce"}, **e)
                        for e in entries]}


def test_diagnosis_prefers_the_flight_recorder():
    last = {0: 100.0, 1: 100.0, 2: 100.0}
    recorders = {0: fr({"collective_seq_id": 7}), 1: fr({"collective_seq_id": 6}), 2: fr({"collective_seq_id": 7})}
    assert hang.diagnose(last, 200.0, 10, recorders) == (
        [1], "never entered collective #7 (gloo:all_reduce) that rank(s) 0, 2 wait in")


def test_diagnosis_ignores_p2p_and_other_groups():
    recorder = fr({"collective_seq_id": 3}, {"collective_seq_id": 9, "is_p2p": True},
                  {"collective_seq_id": 12, "pg_id": 1})
    assert hang.newest_collective(recorder) == (3, "gloo:all_reduce")
    assert hang.newest_collective({"entries": "junk"}) is None


def test_diagnosis_falls_back_to_stacks_then_to_silence():
    last = {0: 100.0, 1: 104.0}
    waiting = "Thread MainThread (id 1) [main]:\n  File \"x/distributed_c10d.py\", line 1, in all_reduce\n"
    sleeping = "Thread MainThread (id 2) [main]:\n  File \"t.py\", line 3, in go_silent\n"
    assert hang.diagnose(last, 200.0, 10, {}, {0: waiting, 1: sleeping}) == (
        [1], "not in a collective, while rank(s) 0 wait in one")
    same = {0: fr({"collective_seq_id": 5}), 1: fr({"collective_seq_id": 5})}
    assert hang.diagnose(last, 200.0, 10, same) == ([0], "silent the longest while other ranks went on")
    assert hang.diagnose({0: 100.0, 1: 101.0}, 200.0, 10, {}) == ([0, 1], "no rank made progress")


def test_main_thread_stack_of_both_formats():
    helper = "# pid\n\nThread MainThread (id 1) [main]:\n  main\n\nThread other (id 2):\n  distributed_c10d.py\n"
    assert not hang.waiting_in_collective(helper)
    py_spy = 'Thread 5 (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:3252)\n'
    assert hang.waiting_in_collective(py_spy)


def test_silent_ranks_and_progress_sources(tmp_path):
    # A sign of life's time is the file's status-change time, which no process can set: the
    # scenario is built on the times the kernel gave the files (the order is the order written).
    run_dir = str(tmp_path)
    os.makedirs(os.path.join(run_dir, "metrics"))
    toucher = hang_files.ProgressToucher(hang_files.progress_dir(run_dir), 0, every=60)
    toucher.touch()
    t0 = os.stat(toucher.path).st_ctime
    time.sleep(0.05)
    with open(os.path.join(run_dir, "metrics", "rank1.jsonl"), "w") as fh:
        fh.write("{}\n")
    t1 = os.stat(os.path.join(run_dir, "metrics", "rank1.jsonl")).st_ctime
    assert t1 > t0 > 1e9
    toucher.touch()  # throttled: within `every` seconds of the last touch nothing is written
    assert os.stat(toucher.path).st_ctime == t0
    assert [hang.last_progress(run_dir, r) for r in (0, 1, 2)] == [t0, t1, None]
    # A rank that never showed a sign of life is starting since the first one started.
    job = hang.job_progress(run_dir, 3, since=t0 - 100)
    assert job == hang.JobProgress({0: t0, 1: t1, 2: t0}, frozenset({2}))
    assert job.silent(now=t0 + 200, timeout=200) == [0, 2]  # the start-up allowance: never below the timeout
    assert job.silent(now=t0 + 100, timeout=50) == [0, 1]  # rank 2 starts: STARTUP_S
    assert job.silent(now=t0 + hang.STARTUP_S, timeout=5) == [0, 1, 2]
    # Signs older than the attempt are an earlier attempt's: rank 0 has not started yet.
    assert hang.job_progress(run_dir, 3, since=(t0 + t1) / 2) == hang.JobProgress({0: t1, 1: t1, 2: t1},
                                                                                   frozenset({0, 2}))
    # Before any rank starts (a queued Slurm job), nothing is silent, however long it waits.
    assert hang.job_progress(run_dir, 3, since=t1 + 100) == hang.JobProgress()
    detector = hang.HangDetector(run_dir, 3, timeout=1, since=t1 + 100)
    assert detector.silent(detector.progress(), now=1e12) == []


def test_a_start_is_not_progress_until_the_rank_shows_some(tmp_path):
    # CI (stop 36): a 2x2 job with hang_timeout 8 on a loaded host was judged hung as a whole, because
    # the wrapper's start counted as progress and importing torch and joining the group took longer
    # than 8 s. A rank's start is now its own mark: silent after STARTUP_S until it shows progress.
    run_dir = str(tmp_path)
    progress = hang_files.progress_dir(run_dir)
    hang_files.mark_started(progress, 0)
    hang_files.mark_started(progress, 1)
    started = hang.last_start(run_dir, 1)
    time.sleep(0.05)
    hang_files.ProgressToucher(progress, 0).touch()
    went_on = hang.last_progress(run_dir, 0)
    job = hang.job_progress(run_dir, 2, since=started - 1)
    assert job.starting == {1} and job.last == {0: went_on, 1: started}
    assert job.silent(now=started + 30, timeout=8) == [0]
    assert job.silent(now=started + hang.STARTUP_S, timeout=8) == [0, 1]
    assert job.silent(now=started + hang.STARTUP_S, timeout=600) == []  # never less than hang_timeout
    # A restart (a new start mark after its progress) makes rank 0 a starting rank again.
    time.sleep(0.05)
    hang_files.mark_started(progress, 0)
    assert hang.job_progress(run_dir, 2, since=started - 1).starting == {0, 1}


def test_a_rank_back_dating_another_ranks_progress_does_not_get_it_blamed(tmp_path):
    # Any process of the job may set rank 1's mtime to the past (issue 22): with mtimes, rank 1
    # was silent "since 1970" and blamed for a hang. The kernel sets the ctime to now on that
    # very change, so the back-dating reads as a sign of life instead.
    run_dir = str(tmp_path)
    for rank in (0, 1):
        hang_files.ProgressToucher(hang_files.progress_dir(run_dir), rank).touch()
    before = hang.last_progress(run_dir, 1)
    os.utime(os.path.join(hang_files.progress_dir(run_dir), "rank1"), (1.0, 1.0))
    assert hang.last_progress(run_dir, 1) >= before
    job = hang.job_progress(run_dir, 2, since=before - 10)
    assert job.silent(now=before + 5, timeout=30) == []


def test_rank_files_are_never_followed_through_symlinks(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("x" * 10)
    link = tmp_path / "rank0.fr.json"
    link.symlink_to(secret)
    assert hang.read_bounded(str(link), 100) is None
    assert hang.read_bounded(str(secret), 5) is None  # over the limit: not read at all
    planted = tmp_path / f".verdict.json.{os.getpid()}.tmp"
    planted.symlink_to(tmp_path / "elsewhere")
    # The temporary name is not predictable any more (dtrain.rundir): a link planted at the old
    # name neither redirects the write nor stops it.
    hang_files.write_private(str(tmp_path / "verdict.json"), b"{}")
    assert not (tmp_path / "elsewhere").exists()
    assert (tmp_path / "verdict.json").read_bytes() == b"{}" and not (tmp_path / "verdict.json").is_symlink()


def test_rank_env_keeps_what_the_user_set():
    env = hang.rank_env("/runs/a", {"TORCH_FR_BUFFER_SIZE": "50"})
    assert env == {"DTRAIN_HANG_DIR": "/runs/a/hang",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": "/runs/a/hang/nccl_trace_rank_"}


@pytest.mark.parametrize("value", [0, -1, "soon", float("nan"), True])
def test_hang_timeout_is_validated(value):
    with pytest.raises(SpecError) as e:
        LaunchSpec(command=["python", HANG_TRAIN], hang_timeout=value)
    assert e.value.field == "hang_timeout"


def test_cli_refuses_a_bad_hang_timeout_before_anything_starts(tmp_path):
    run = launch_cli(tmp_path / "never", "--hang-timeout", "0")
    assert run.returncode == 2 and "hang_timeout=0.0 is invalid" in run.stderr
    assert not (tmp_path / "never").exists()


def test_operator_fails_naming_the_stuck_rank_with_the_verdict_in_xcom(airflow_db, tmp_path):
    from tests.conftest import load_test_dag

    dag = load_test_dag("hang_dags.py", "hang_test")
    dag_run = dag.test(run_conf={"hang_timeout": str(TIMEOUT), "run_dir": str(tmp_path)})
    ti = next(t for t in dag_run.get_task_instances() if t.task_id == "train")
    assert ti.state == "failed"
    verdict = ti.xcom_pull(task_ids="train", key="hang")
    assert verdict["stuck_ranks"] == [1] and sorted(verdict["stacks"]) == ["0", "1"]
    assert "rank(s) 1 stuck" in verdict["message"]
    assert verdict["detected_at"] - went_silent_at(str(tmp_path)) <= DETECTION_BOUND


def test_operator_turns_hang_detection_on_by_default_and_off_with_none():
    from dtrain.launch.airflow.operator import DEFAULT_HANG_TIMEOUT, DistributedTrainingOperator

    on = DistributedTrainingOperator(task_id="a", command=[HANG_TRAIN], device="cpu")
    off = DistributedTrainingOperator(task_id="b", command=[HANG_TRAIN], device="cpu", hang_timeout=None)
    assert on.build_spec({"run_id": "r"}).hang_timeout == DEFAULT_HANG_TIMEOUT == 1800
    assert off.build_spec({"run_id": "r"}).hang_timeout is None


def test_deferred_ssh_job_hang_is_caught_by_the_trigger(ssh_cluster, tmp_path):
    """Deferrable mode: the trigger (rebuilt from its kwargs, as a triggerer would) watches the
    progress files, collects the stacks, cancels the job on both hosts, and the task fails with 124."""
    from airflow.sdk.exceptions import TaskDeferred

    from dtrain.errors import LaunchError
    from dtrain.launch.airflow.deferrable import defer_job
    from dtrain.launch.airflow.operator import DistributedTrainingOperator
    from tests.launch.backends.ssh.remote.test_ssh_deferrable import first_event, job_pids, rebuilt

    spec = LaunchSpec(command=["python", HANG_TRAIN, "--silent-rank", "2", "--silent-step", "4"], nodes=2,
                      procs_per_node=2, backend="ssh", device="cpu", run_dir=str(tmp_path), hang_timeout=TIMEOUT,
                      env={"GLOO_SOCKET_IFNAME": "lo"}, workdir=REPO,
                      backend_options={"hostfile": ssh_cluster.hostfile(2), **ssh_cluster.ssh_settings()})
    op = DistributedTrainingOperator(task_id="train", command=spec.command, backend="ssh", deferrable=True)
    with pytest.raises(TaskDeferred) as deferred:
        defer_job(op, spec, context={})
    trigger = rebuilt(deferred.value.trigger)
    assert trigger.hang_timeout == TIMEOUT
    trigger.poll_interval = 0.5
    event = first_event(trigger, timeout=180)
    assert event["status"] == "hung" and event["hang"]["stuck_ranks"] == [2]
    assert event["hang"]["detected_at"] - went_silent_at(str(tmp_path)) <= DETECTION_BOUND
    assert sorted(event["hang"]["stacks"]) == ["0", "1", "2", "3"]
    assert not job_pids(event["handle"]["job_id"])  # cancelled on both hosts
    with pytest.raises(LaunchError) as failure:
        op.execute_complete({}, event)
    assert failure.value.exit_code == hang.HANG_EXIT_CODE and "rank(s) 2 stuck" in str(failure.value)
