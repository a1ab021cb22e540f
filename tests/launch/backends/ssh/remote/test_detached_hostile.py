"""Detached SSH nodes against hostile ranks (issue #22): what a rank writes in the run directory's
``detached`` folder decides nothing. Real jobs on the real sshd hosts of ``ssh_cluster``,
real ``detached_node`` verbs over ssh; the ranks are tests/launch/backends/ssh/remote/forge_detached.py.

* a state record copied from another job's run directory (real PIDs and start times) does not
  make this job's stop signal that job, with the job's secret or without it (a resumed task);
* the daemon's own exit record is not written through a link planted at its temp-file name;
* the records are signed (HMAC-SHA256, per-job secret) and checked field by field, and a host's
  status answer is checked before it is believed;
* ``detached_node`` refuses bad input on its command line and stdin with exit status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from dtrain.launch.backends import JobHandle
from dtrain.launch.backends.ssh import detached as nodes
from dtrain.launch.backends.ssh.detached_node import MODULE, paths, status_from_files
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from dtrain.launch.node.records import JobKey, RecordError, parse
from tests.remote_jobs import job_processes, needs_sshd, still_alive
from tests.support import poll_until, wait_for

pytestmark = [needs_sshd, pytest.mark.timeout(180)]
FORGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forge_detached.py")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture
def submit(ssh_cluster, tmp_path):
    """Submit detached 2-host jobs (one rank per host); every one is stopped at teardown, pass or fail."""
    launched: list[tuple[Launcher, JobHandle]] = []

    def submit_job(name: str, command: list[str]) -> tuple[Launcher, JobHandle]:
        spec = LaunchSpec(command=command, nodes=2, procs_per_node=1, backend="ssh", device="cpu",
                          run_dir=str(tmp_path / name), stop_grace=2,
                          backend_options={"hostfile": ssh_cluster.hostfile(1), **ssh_cluster.ssh_settings()})
        launcher = Launcher(spec, sink=lambda line: None)
        handle = launcher.submit_detached()
        launched.append((launcher, handle))
        return launcher, handle

    yield submit_job
    for launcher, handle in launched:
        launcher.backend.cancel(handle, grace=1)
        for proc in job_processes(handle.job_id):
            proc.kill()


def forged(run_dir: str, ranks=(0, 1)) -> bool:
    return all(os.path.exists(os.path.join(run_dir, f"forged-{rank}")) for rank in ranks)


def up(handle: JobHandle) -> list[psutil.Process]:
    """Once both hosts run their daemon, torchrun and rank: each node's daemon and every process
    below it (from its state records: a job whose ranks forge nothing)."""
    wait_for(lambda: len(job_processes(handle.job_id)) >= 6, 60, what=f"job {handle.job_id} up on both hosts")
    daemons = []
    for node in (0, 1):
        with open(paths(handle.run_dir, node)["state"], encoding="utf-8") as fh:
            daemons.append(psutil.Process(json.load(fh)["pid"]))
    return daemons + [child for daemon in daemons for child in daemon.children(recursive=True)]


@pytest.mark.parametrize("secret", ["with the job's secret", "without it (a task resumed from an event)"])
def test_a_state_record_copied_from_another_job_does_not_get_that_job_stopped(submit, secret):
    _, victim = submit("victim", SLEEPER)
    victim_procs = up(victim)
    victim_seen = still_alive(victim_procs)
    launcher, handle = submit("forger", [sys.executable, FORGE, "state", victim.run_dir])
    wait_for(lambda: len(job_processes(handle.job_id)) >= 6, 60, what="the forging job up on both hosts")
    ours = job_processes(handle.job_id)  # by its job id (its state records may be forged already)
    wait_for(lambda: forged(handle.run_dir, (0,)), 60, what="the forged state records")
    with open(paths(handle.run_dir, 0)["state"], encoding="utf-8") as fh:
        assert json.load(fh)["job_id"] == victim.job_id  # the victim's own signed record, verbatim
    notes: list[str] = []
    launcher.backend.sink = notes.append
    chosen = handle if secret.startswith("with ") else JobHandle.from_dict(handle.public())
    launcher.backend.cancel(chosen, grace=2)

    assert still_alive(victim_procs) == victim_seen, \
        "the forged state record got another job's processes signalled"  # the other job untouched...
    assert poll_until(lambda: not still_alive(ours), 30), still_alive(ours)  # ...this one stopped
    expected = "ignored detached/node0.state.json" if chosen is handle else "refused PID"
    assert any(expected in note for note in notes), notes  # and the host said why it did not believe it


def test_the_daemon_does_not_write_its_exit_record_through_a_planted_link(submit, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    launcher, handle = submit("job", [sys.executable, FORGE, "tmplink", str(victim)])
    status = wait_for(lambda: (s := launcher.backend.poll(handle)).done and s, 60, what="the job to end")
    assert victim.read_text() == "precious\n"  # a daemon writing through the link would have replaced it
    assert forged(handle.run_dir) and (status.state, status.exit_code) == ("COMPLETED", 0), status


def test_records_are_signed_for_one_job_node_and_kind_and_checked_field_by_field():
    key = JobKey("job-a", "0f" * 32)
    fields = {"exit_code": 3, "stopped_by_signal": None, "time": 1.5}
    record = parse(json.dumps(key.sign("exit", 1, fields)).encode())
    assert key.verify("exit", 1, record)["exit_code"] == 3
    refusals = {
        "a changed field": {**record, "exit_code": 0},
        "an infinite field": {**record, "exit_code": parse(b"1e999")},
        "no MAC": {k: v for k, v in record.items() if k != "mac"},
        "another node": key.sign("exit", 0, fields),
        "another kind": key.sign("state", 1, fields),
        "another job": JobKey("job-b", "0f" * 32).sign("exit", 1, fields),
        "another secret": JobKey("job-a", "1e" * 32).sign("exit", 1, fields),
    }
    # Signed with the right key, but not what the daemon writes: refused too, never raised.
    for value in ("x", 1e300, [1], True, 256, -1, None):
        refusals[f"exit_code={value!r}"] = key.sign("exit", 1, {**fields, "exit_code": value})
    for why, value in refusals.items():
        with pytest.raises(RecordError):
            key.verify("exit", 1, value)
            pytest.fail(f"believed a record with {why}")
    for raw in (b"[" * 100000 + b"]" * 100000, b"\xff", b"{"):  # too deep to parse, not UTF-8, cut
        with pytest.raises(RecordError):
            parse(raw)
    assert "0f0f" not in repr(key)


def test_a_node_that_was_stopped_never_reads_as_a_success(tmp_path):
    """Its agent may exit 0 after a stop (seen here: torchrun stopped with a sleeping rank, one run in
    three): the node still failed, with 143, as the retry policy reads a preemption."""
    key, run_dir = JobKey("job", "ab" * 32), str(tmp_path)
    os.makedirs(os.path.dirname(paths(run_dir, 0)["exit"]))
    with open(paths(run_dir, 0)["exit"], "w", encoding="utf-8") as fh:
        json.dump(key.sign("exit", 0, {"exit_code": 0, "stopped_by_signal": 15, "time": 1.0}), fh)
    node = status_from_files(run_dir, 0, 2.0, 15, key=key)
    status = nodes.decide([node])
    assert (status.state, status.done, status.exit_code, status.ok) == ("FAILED", True, 143, False)


def test_a_host_answer_is_believed_only_as_a_node_status():
    good = {"state": "exited", "exit_code": 3, "tail": ["boom"], "ignored": []}
    assert nodes.parse_status(0, 0, json.dumps(good), "")["exit_code"] == 3
    for bad in ({**good, "exit_code": "x"}, {**good, "exit_code": 1e300}, {**good, "exit_code": [1]},
                {**good, "state": "done"}, {**good, "tail": "boom"}, {**good, "state": "running"},
                {**good, "exit_code": None}):
        answer = nodes.parse_status(0, 0, json.dumps(bad), "")
        assert answer["state"] == "unreachable", bad  # not a verdict: asked again, then given up and cancelled
        assert nodes.decide([answer]).reachable is False


def run_node(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", MODULE, *args], input=stdin, capture_output=True, timeout=60)


def test_bad_input_to_detached_node_exits_2_naming_it_before_anything_is_created(tmp_path):
    run_dir, job = str(tmp_path / "run"), f"dtrain-bad-input-{os.getpid()}"
    cases = [
        (["status", "--run-dir", "relative/run", "--node", "0", "--job-id", job], b"", "--run-dir"),
        (["status", "--run-dir", run_dir + "/../x", "--node", "0", "--job-id", job], b"", "--run-dir"),
        (["status", "--run-dir", run_dir, "--node", "0", "--job-id", job + ";rm"], b"", "--job-id"),
        (["stop", "--run-dir", run_dir, "--node", "-1", "--job-id", job], b"", "--node"),
        (["stop", "--run-dir", run_dir, "--node", "0", "--job-id", job, "--grace", "nan"], b"", "--grace"),
        (["start", "--run-dir", run_dir, "--node", "0", "--job-id", job, "--", "true"],
         b'{"env": {}, "secret": "not-hex"}\n', "secret='<not shown>'"),
        (["start", "--run-dir", run_dir, "--node", "0", "--job-id", job, "--", "true"], b'{"env": {}}\n', "secret"),
        (["start", "--run-dir", run_dir, "--node", "0", "--job-id", job, "--", "true"],
         b'{"env": {"A": 1}, "secret": "' + b"ab" * 32 + b'"}\n', "env"),
        (["status", "--run-dir", run_dir, "--node", "0", "--job-id", job], b"[1]\n", "stdin"),
        (["start", "--run-dir", run_dir, "--node", "0", "--job-id", job, "--lease", "1", "--", "true"], b"", "--lease"),
        (["start", "--run-dir", run_dir, "--node", "0", "--job-id", job, "--peer", "-oProxyCommand=x:22", "--", "true"],
         b"", "--peer"),
        (["start", "--run-dir", run_dir, "--node", "0", "--job-id", job, "--peer", "10.0.0.1:0", "--", "true"], b"", "--peer"),
        (["start", "--run-dir", run_dir, "--node", "0", "--job-id", job, "--peer", "root@h:22", "--", "true"], b"", "--peer"),
    ]
    for argv, stdin, field in cases:
        done = run_node(*argv, stdin=stdin)
        assert done.returncode == 2 and field in done.stderr.decode(), (argv, done.stderr.decode()[-400:])
    assert not os.path.exists(run_dir) and job_processes(job) == []  # nothing created, nothing started
