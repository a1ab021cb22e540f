"""A node's lease records decide nothing a rank can write: the holder signs its beats and fences with the
job's lease key, which it reads on stdin (never an argv, its environment or the run directory), and a
beat's age is its file's ctime, which ``os.utime`` cannot back-date. The real holder process
(``python -m dtrain.launch.backends.slurm.node_lease``), its records read as the launcher reads them;
tests/launch/node/faults/test_lease_forgery.py forges them from a rank of a real job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dtrain.errors import SpecError
from dtrain.launch.backends.slurm import lost
from dtrain.launch.backends.slurm.render import node_secrets
from dtrain.launch.node import lease
from dtrain.launch.node.records import RecordError
from dtrain.rundir import LEASE, RunDir
from tests.support import poll_until

JOB = "dtrain-lease-forgery"
SECRET = "c3" * 32
KEY = lost.job_key(JOB, {"secret": SECRET})


@pytest.fixture
def holder(tmp_path):
    """A node's lease holder as Slurm's node shell starts it, its key on stdin; (process, run dir)."""
    run_dir = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_NODELIST"}
    proc = subprocess.Popen([sys.executable, "-m", "dtrain.launch.backends.slurm.node_lease", "--run-dir", run_dir,
                             "--node", "1", "--job-id", JOB, "--lease", "30"],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    proc.stdin.write(node_secrets(lease.lease_key(SECRET)) + "\n")
    proc.stdin.close()
    yield proc, RunDir(run_dir)
    proc.kill()
    proc.wait()


def test_the_holder_signs_its_beats_with_the_key_from_its_stdin_and_nowhere_else(holder):
    proc, files = holder
    assert poll_until(lambda: lease.beat_age(files, JOB, 1, time.time(), KEY) is not None, 30, 0.1), proc.stderr
    key = lease.lease_key(SECRET)
    with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
        assert key.encode() not in fh.read()
    with open(f"/proc/{proc.pid}/environ", "rb") as fh:
        assert key.encode() not in fh.read()
    assert os.readlink(f"/proc/{proc.pid}/fd/0") == os.devnull  # read, then closed
    with pytest.raises(RecordError, match="MAC does not verify"):  # another job's key
        lease.beat_age(files, JOB, 1, time.time(), lost.job_key(JOB, {"secret": "d4" * 32}))


def test_a_rank_cannot_back_date_a_beat_nor_forge_one_or_a_fence(holder):
    proc, files = holder
    assert poll_until(lambda: lease.beat_age(files, JOB, 1, time.time(), KEY) is not None, 30, 0.1)
    beat = files.join(LEASE, JOB, lease.beat_name(1))
    long_ago = time.time() - 3600
    os.utime(beat, (long_ago, long_ago))  # what a rank can do to the holder's own beat
    assert lease.beat_age(files, JOB, 1, time.time(), KEY) < 5.0
    files.write(LEASE, JOB, lease.beat_name(1), data=json.dumps({"time": long_ago}).encode())
    with pytest.raises(RecordError, match="not signed"):
        lease.beat_age(files, JOB, 1, time.time(), KEY)
    files.write(LEASE, JOB, lease.fenced_name(1), data=json.dumps({"time": 1.0, "reason": "forged"}).encode())
    with pytest.raises(RecordError, match="not signed"):
        lease.read_fence(files, JOB, 1, KEY)
    forged = KEY.sign("fence", 1, {"time": 1.0, "reason": "forged"}) | {"reason": "changed"}
    files.write(LEASE, JOB, lease.fenced_name(1), data=json.dumps(forged).encode())
    with pytest.raises(RecordError, match="MAC does not verify"):
        lease.read_fence(files, JOB, 1, KEY)


def read_key_from(text: str):
    """(what :func:`lease.read_key` made of ``text`` on its fd, what was left in the pipe, what the fd reads
    after): the key's line only is taken, and the fd then points at /dev/null."""
    read_end, write_end = os.pipe()
    os.write(write_end, text.encode())
    os.close(write_end)
    pipe = os.dup(read_end)
    try:
        try:
            return lease.read_key(read_end, JOB), os.read(pipe, 4096), os.read(read_end, 4096)
        except SpecError as e:
            return e, os.read(pipe, 4096), os.read(read_end, 4096)
    finally:
        os.close(read_end)
        os.close(pipe)


def test_the_key_line_is_read_once_and_a_bad_one_is_named_never_shown():
    line = node_secrets(lease.lease_key(SECRET))
    key, left, after = read_key_from(line + "\n" + "the rest is not read\n")
    assert (key.secret, left, after) == (lease.lease_key(SECRET), b"the rest is not read\n", b"")
    assert read_key_from("") == (None, b"", b"")  # none given: the lease holds unsigned
    error, left, after = read_key_from('{"lease_key": "%s"}\nrest\n' % ("x" * 64))
    assert isinstance(error, SpecError) and '"lease_key"' in str(error) and "x" * 64 not in str(error)
    assert (left, after) == (b"rest\n", b"")  # stdin is /dev/null even after a bad line


def test_a_holder_that_read_its_key_is_not_dumpable():
    """Another process of the ranks' user can then neither read its memory nor attach to it (root can)."""
    code = ("import ctypes; from dtrain.launch.node import lease; prctl = ctypes.CDLL(None).prctl; "
            "before = prctl(3, 0, 0, 0, 0); lease.read_key(0, 'j'); print(before, prctl(3, 0, 0, 0, 0))")
    proc = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.split() == ["1", "0"], proc.stderr  # PR_GET_DUMPABLE


def test_an_unsigned_fence_the_probe_contradicts_makes_a_suspect_named_once(tmp_path):
    """mpi's leases (key None): a fence record is a hint; every node answering the probe contradicts it."""
    from dtrain.launch.core.lost import TellOnce, lost_by_leases

    files = RunDir(str(tmp_path))
    files.write(LEASE, JOB, lease.fenced_name(1), data=json.dumps({"time": 1.0, "reason": "cut off"}).encode())
    told: list[str] = []
    tell = TellOnce(told.append)
    answers: dict[tuple[str, int], tuple[str, str] | None] = {("10.0.0.1", 22): None, ("10.0.0.2", 22): None}

    def decide():
        return lost_by_leases(files.path, JOB, 2, 30.0, failed=False, hosts=lambda: list(answers), silent_daemon=None,
                              probe=lambda address, port: answers[(address, port)], key=None, report=tell)

    assert decide() is None and decide() is None
    assert told == ["[dtrain] node 1 (10.0.0.2) suspect: an unsigned fence record says it fenced itself (cut off), "
                    "but every node answers the probe: not declared lost"]
    answers[("10.0.0.2", 22)] = ("unreachable", "no answer")  # the probe agrees: a partition
    found = decide()
    assert (found.node, found.fault, found.detail) == (1, "unreachable", "no answer; it fenced itself: cut off")
