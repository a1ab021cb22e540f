"""Bad CLI input as a user (or a script templating a UI param) can type it, against the real
``dtrain`` console script: a file argument that never ends (/dev/zero), blocks (a FIFO), is huge
(a sparse 2 GiB file), or a number that is NaN, negative or absurd, must exit 2 with a message
naming the field and the value, never a traceback and never an unbounded read. Each run has an
address-space limit, so a read without a bound fails the test instead of the machine."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from tests.conftest import REPO

DTRAIN = os.path.join(os.path.dirname(sys.executable), "dtrain")
MEMORY_LIMIT = 1 << 30  # the CLI needs about 30 MB; an unbounded read of /dev/zero hits this


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def dtrain(*argv: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    # A timeout, not a timing assert: a blocked read (a FIFO) fails the test instead of hanging it.
    return subprocess.run([DTRAIN, *argv], capture_output=True, text=True, timeout=120, cwd=cwd,
                          preexec_fn=_limit_memory)


def refused(proc: subprocess.CompletedProcess, *expected: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for text in expected:
        assert text in proc.stderr, (text, proc.stderr[-2000:])


@pytest.fixture
def odd_files(tmp_path):
    """A FIFO, a sparse 2 GiB regular file and a directory: none of them is a small input file."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as fh:
        fh.truncate(2 << 30)
    return {"fifo": str(fifo), "huge": str(huge), "dir": str(tmp_path)}


def file_argument_commands(path: str, tmp_path) -> dict[str, tuple[list[str], str]]:
    """Every CLI argument that names a file to read, with ``path`` in it, and the field it names."""
    return {
        "launch --hostfile": (["launch", "--backend", "ssh", "--hostfile", path, "--dry-run", "--",
                               "python", "train.py"], "hostfile="),
        "plan --table": (["plan", "--dataset-size", "1GB", "--epoch-seconds", "30", "--table", path], "table="),
        "stage --storage-options @FILE": (["stage", str(tmp_path / "src"), str(tmp_path / "dst"),
                                           "--storage-options", "@" + path], "--storage-options="),
    }


@pytest.mark.parametrize("command", ["launch --hostfile", "plan --table", "stage --storage-options @FILE"])
@pytest.mark.parametrize("kind, allowed", [("/dev/zero", "a regular file"), ("fifo", "a regular file"),
                                           ("dir", "a regular file"), ("huge", "a file of at most 1048576 bytes")])
def test_file_arguments_are_regular_files_read_with_a_bound(command, kind, allowed, odd_files, tmp_path):
    path = odd_files.get(kind, kind)
    argv, field = file_argument_commands(path, tmp_path)[command]
    refused(dtrain(*argv), field, repr(path), allowed)
    assert not (tmp_path / "dst").exists()  # nothing was created


def test_a_good_small_file_still_works(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"MYFS": {"throughput_mbps_per_tib": [1000],
                                                          "capacity_tib": {"first": [1.0], "increment": 1.0}}}))
    proc = dtrain("plan", "--dataset-size", "100GB", "--epoch-seconds", "30", "--table", str(tmp_path / "t.json"))
    assert proc.returncode == 0 and "MYFS at 1000 MB/s/TiB: 4 TiB -> 4.00 GB/s" in proc.stdout, proc.stderr
    (tmp_path / "hosts").write_text("10.9.0.1 slots=1\n")  # read and parsed: one host for two nodes
    proc = dtrain("launch", "--backend", "ssh", "--hostfile", str(tmp_path / "hosts"), "--nodes", "2", "--dry-run",
                  "--", "python", "train.py")
    refused(proc, f"at most the 1 host(s) listed in hostfile {tmp_path / 'hosts'}")


@pytest.mark.parametrize("value, allowed", [("nan", "a finite number"), ("-1", "a finite number"),
                                            ("inf", "a finite number"), ("0", "greater than 0")])
def test_stage_progress_interval_is_a_positive_finite_number(value, allowed, tmp_path):
    (tmp_path / "src").mkdir()
    proc = dtrain("stage", str(tmp_path / "src"), str(tmp_path / "dst"), "--progress-interval", value)
    refused(proc, "progress_interval=", allowed)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("value, shown", [("1e22", "nodes=10000000000000000000000"),
                                          ("10000000000000000000000", "nodes=10000000000000000000000"),
                                          ("0", "nodes=0"), ("2.5", "nodes=2.5"), ("many", "nodes='many'")])
def test_plan_nodes_is_a_bounded_integer(value, shown):
    refused(dtrain("plan", "--dataset-size", "1GB", "--epoch-seconds", "30", "--nodes", value), shown)


def test_autotune_work_dir_that_cannot_be_made_exits_2(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    script = os.path.join(REPO, "tests", "deepspeed", "scripts", "ds_zero_style.py")
    proc = dtrain("autotune", "--deepspeed-config", str(config), "--device", "cpu", "--work-dir", "/dev/null/x",
                  "--", "python", script)
    refused(proc, "work_dir='/dev/null/x'", "a directory")
