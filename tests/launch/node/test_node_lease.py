"""The node-side lease process a Slurm node runs beside its agent (``python -m dtrain.launch.node.lease``):
it beats in the run directory, and when it cannot reach its peer for the lease it stops every process of
its job's node on this host (not itself, not its parent: the node shell), records why, and beats no more.
Its arguments are checked before anything starts. Short timings, a real listening socket for the peer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from dtrain.launch.node import lease
from dtrain.launch.node.records import RecordError
from dtrain.rundir import LEASE, RunDir
from tests.support import poll_until

JOB = "dtrain-lease-test"


@pytest.fixture
def rank(tmp_path):
    """A stand-in rank of node 1 of JOB (its environment says so), ignoring SIGTERM as a saving rank does."""
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    env = {**os.environ, "DTRAIN_JOB_ID": JOB, "DTRAIN_NODE_INDEX": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    yield proc
    proc.kill()
    proc.wait()


def test_a_cut_off_node_fences_its_ranks_records_why_and_stops_beating(tmp_path, rank):
    run_dir = str(tmp_path / "run")
    listener = socket.create_server(("127.0.0.1", 0))
    peer = listener.getsockname()
    holder = threading.Thread(target=lease.run, args=(run_dir, 1, JOB, 0.6, peer),
                              kwargs={"check_every": 0.05, "heartbeat": 0.1}, daemon=True)
    holder.start()
    files = RunDir(run_dir)
    assert poll_until(lambda: lease.beat_age(files, JOB, 1, time.time()) is not None, 5, 0.05)
    time.sleep(1.0)  # longer than the lease: it reaches its peer, so it holds
    assert rank.poll() is None and holder.is_alive() and lease.read_fence(files, JOB, 1) is None
    listener.close()  # cut off (the peer refuses: fast here)
    holder.join(10)
    assert not holder.is_alive()
    assert rank.wait(timeout=10) == -signal.SIGKILL  # SIGTERM ignored: killed after the fence grace
    reason = lease.read_fence(files, JOB, 1)
    assert reason.startswith(f"this node could not reach its peer 127.0.0.1:{peer[1]} for "), reason
    age = lease.beat_age(files, JOB, 1, time.time())
    time.sleep(0.5)
    assert lease.beat_age(files, JOB, 1, time.time()) >= age + 0.4  # a fenced node beats no more


def test_a_fence_record_is_read_as_untrusted_text(tmp_path):
    files = RunDir(str(tmp_path))
    files.ensure_dir(LEASE, JOB)
    files.write(LEASE, JOB, lease.fenced_name(0), data=json.dumps({"time": 1.0, "reason": "cut\x1b[2J off\n"}).encode())
    assert lease.read_fence(files, JOB, 0) == "cut?[2J off?"  # no control character reaches a log line
    files.write(LEASE, JOB, lease.fenced_name(0), data=json.dumps({"time": 1.0, "reason": "x" * 100_000}).encode())
    assert lease.read_fence(files, JOB, 0) is None  # larger than any fence record: not read, ignored
    files.write(LEASE, JOB, lease.fenced_name(0), data=b"\x00not json")
    with pytest.raises(RecordError, match="not JSON"):
        lease.read_fence(files, JOB, 0)
    os.remove(files.join(LEASE, JOB, lease.fenced_name(0)))
    os.symlink("/etc/passwd", files.join(LEASE, JOB, lease.fenced_name(0)))
    assert lease.read_fence(files, JOB, 0) is None  # a planted link is not followed


@pytest.mark.parametrize("argv, named", [
    (["--node", "1", "--job-id", "a;b", "--lease", "30"], "--job-id='a;b'"),
    (["--node", "-1", "--job-id", JOB, "--lease", "30"], "--node='-1'"),
    (["--node", "1", "--job-id", JOB, "--lease", "nan"], "--lease='nan'"),
    (["--node", "1", "--job-id", JOB, "--lease", "1"], "--lease='1'"),
    (["--node", "1", "--job-id", JOB, "--lease", "30", "--peer", "host;rm:22"], "--peer='host;rm:22'"),
    (["--node", "1", "--job-id", JOB, "--lease", "30", "--peer", "host:0"], "--peer='host:0'"),
])
def test_bad_arguments_exit_2_naming_the_field_before_anything_starts(tmp_path, argv, named):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "dtrain.launch.node.lease", "--run-dir", str(run_dir), *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert not run_dir.exists()


def env_asking(node: str = "1", local_rank: str = "0", **over) -> dict[str, str]:
    """A rank's environment under mpirun over ssh: the launcher asked every node for a lease of 30 s."""
    return {"DTRAIN_NODE_INDEX": node, "LOCAL_RANK": local_rank, "DTRAIN_JOB_ID": JOB, "DTRAIN_RUN_DIR": "/tmp/run",
            **lease.lease_env([("10.0.0.1", 22), ("10.0.0.2", 2222), ("fd00::3", 22)], 30.0), **over}


def test_the_lease_variables_name_each_nodes_peer_the_next_node_and_are_taken_out_of_the_env():
    environ = env_asking()
    assert environ[lease.PEERS_ENV] == "10.0.0.1:22,10.0.0.2:2222,[fd00::3]:22"
    assert lease.lease_of_env(environ) == (1, 30.0, ("fd00::3", 22))
    assert lease.LEASE_ENV not in environ and lease.PEERS_ENV not in environ  # the rank does not inherit them
    assert lease.lease_of_env(env_asking(node="2")) == (2, 30.0, ("10.0.0.1", 22))  # the last node's: node 0
    assert lease.lease_of_env({"DTRAIN_NODE_INDEX": "0", **lease.lease_env([("h", 22)], 12)}) == (0, 12.0, None)
    assert lease.lease_of_env({"DTRAIN_NODE_INDEX": "0"}) is None  # no lease asked for


@pytest.mark.parametrize("over, named", [
    ({lease.LEASE_ENV: "nan"}, lease.LEASE_ENV), ({lease.LEASE_ENV: "1"}, lease.LEASE_ENV),
    ({lease.PEERS_ENV: "h;rm:22"}, lease.PEERS_ENV), ({lease.PEERS_ENV: "h:0"}, lease.PEERS_ENV),
    ({"DTRAIN_NODE_INDEX": "3"}, "DTRAIN_NODE_INDEX"), ({"DTRAIN_NODE_INDEX": "1.5"}, "DTRAIN_NODE_INDEX"),
    ({"DTRAIN_JOB_ID": "a/../b"}, "DTRAIN_JOB_ID"), ({"DTRAIN_RUN_DIR": "run"}, "run_dir='run'"),
])
def test_a_bad_lease_variable_holds_no_lease_and_says_which(over, named, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(lease.threading, "Thread", lambda **kw: started.append(kw))
    environ = env_asking(**over)
    assert lease.start_from_env(environ) is False and started == []
    err = capsys.readouterr().err
    assert err.startswith(f"{lease.ANNOUNCE} no lease held: ") and named in err, err
    assert lease.LEASE_ENV not in environ and lease.PEERS_ENV not in environ


def test_only_a_nodes_local_rank_0_holds_its_lease(monkeypatch):
    started = []

    class Thread:
        def __init__(self, target, args, name, daemon):
            started.append((target, args, name, daemon))

        def start(self):
            pass

    monkeypatch.setattr(lease.threading, "Thread", Thread)
    environ = env_asking(local_rank="1")
    assert lease.start_from_env(environ) is False and started == [] and lease.LEASE_ENV not in environ
    assert lease.start_from_env(env_asking()) is True
    assert started == [(lease.run, ("/tmp/run", 1, JOB, 30.0, ("fd00::3", 22)), "dtrain-lease", True)]
