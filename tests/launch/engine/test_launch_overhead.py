"""What `dtrain launch` adds to a job's start and run: only the launch subcommand's imports, a rank
wrapper without the lease's imports, and a launcher that sleeps until an agent ends instead of
polling on a short interval (their speed is measured in bench/launch.py; here, that each holds)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import threading

import pytest

import dtrain.cli
import dtrain.launch.backends.local as local_module
from dtrain.launch.backends.base import JobHandle
from dtrain.launch.backends.local import LocalBackend
from dtrain.launch.node import lease, rank_entry


def imported_after(code: str, modules: list[str]) -> list[str]:
    """Which of ``modules`` a fresh interpreter has imported after running ``code``."""
    probe = f"{code}\nimport sys\nprint(','.join(m for m in {modules!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [m for m in done.stdout.strip().split(",") if m]


def subcommands_of(parser: argparse.ArgumentParser) -> set[str]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


def test_the_subcommand_table_names_what_each_module_registers():
    assert subcommands_of(dtrain.cli.build_parser([])) == set(dtrain.cli.SUBCOMMANDS)
    for name in dtrain.cli.SUBCOMMANDS:
        assert name in subcommands_of(dtrain.cli.build_parser([name]))


def test_dtrain_launch_imports_no_other_subcommand():
    others = sorted(set(dtrain.cli.SUBCOMMAND_MODULES) - {dtrain.cli.SUBCOMMANDS["launch"]})
    code = "from dtrain.cli import build_parser\nbuild_parser(['launch', '--', 'true']).parse_args(['launch', '--', 'true'])"
    assert imported_after(code, others + ["dtrain.launch.engine.cli"]) == ["dtrain.launch.engine.cli"]


def test_help_without_a_subcommand_still_lists_every_one():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        dtrain.cli.main(["--help"])
    for name in dtrain.cli.SUBCOMMANDS:
        assert name in out.getvalue()


def test_a_new_job_id_needs_no_uuid_import():
    code = ("from dtrain.launch.core.spec import LaunchSpec\nfrom dtrain.launch.core.job import prepare_job\n"
            "job = prepare_job(LaunchSpec(command=['true']), create=False)\n"
            "import re\nassert re.fullmatch(r'dtrain-[0-9a-f]{12}', job.job_id), job.job_id")
    assert imported_after(code, ["uuid"]) == []


def test_the_rank_wrapper_imports_neither_the_lease_nor_argparse():
    assert imported_after("import dtrain.launch.node.rank_entry",
                          ["dtrain.launch.node.lease", "argparse"]) == []


#: what every rank's wrapper of a job on one host need not import (each is an interpreter of its own)
NOT_IN_A_WRAPPER = ["dataclasses", "secrets", "shutil", "psutil", "asyncio"]


def test_a_rank_wrapper_of_a_one_host_job_imports_nothing_it_does_not_use():
    code = ("import dtrain.launch.node.rank_entry as entry\n"
            "assert entry.socket_ifname_env({'MASTER_ADDR': '127.0.0.1'}) == "
            "{'GLOO_SOCKET_IFNAME': 'lo', 'NCCL_SOCKET_IFNAME': 'lo'}\n"
            "from dtrain.atomic import temp_name\nassert temp_name('x') != temp_name('x')")
    assert imported_after(code, NOT_IN_A_WRAPPER) == []


def test_a_launch_imports_neither_asyncio_nor_statistics_for_a_job_without_metrics(tmp_path):
    code = ("from dtrain.cli import build_parser\nbuild_parser(['launch', '--', 'true']).parse_args(['launch', '--', 'true'])\n"
            "import dtrain.launch.engine.launcher, dtrain.launch.backends.local\n"
            "from dtrain.stall_report import summarize\n"
            f"summarize({str(tmp_path / 'metrics')!r})")
    assert imported_after(code, ["asyncio", "statistics"]) == []


def test_a_lease_request_still_reaches_the_lease(capsys):
    assert lease.LEASE_ENV.startswith(rank_entry.LEASE_VARS_PREFIX)
    assert lease.PEERS_ENV.startswith(rank_entry.LEASE_VARS_PREFIX)
    environ = {lease.LEASE_ENV: "not a number", lease.PEERS_ENV: "", "LOCAL_RANK": "0"}
    rank_entry.start_lease(environ)
    assert lease.LEASE_ENV not in environ and lease.PEERS_ENV not in environ  # taken out: ranks never see them
    assert "no lease held" in capsys.readouterr().err


def watch_in_thread(backend: LocalBackend, argv: list[str], tmp_path) -> tuple[threading.Thread, dict]:
    backend.supervisor.start([argv], [dict(os.environ)])
    handle = JobHandle(backend="local", job_id="j", backend_job_id="j", run_dir=str(tmp_path), world_size=1,
                       submitted_at=0.0, data={"nodes": 1})
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(outcome=backend.watch(handle, grace=1.0)), daemon=True)
    thread.start()
    return thread, result


@pytest.fixture
def counted_backend(monkeypatch):
    """A local backend whose idle bound is an hour (only an agent's end or a stop can wake its watch),
    counting the supervisor's checks."""
    monkeypatch.setattr(local_module, "IDLE_CHECK_S", 3600.0)
    backend = LocalBackend(sink=lambda line: None)
    checks = []
    check = backend.supervisor.check
    backend.supervisor.check = lambda expected: checks.append(1) or check(expected)
    return backend, checks


@pytest.mark.parametrize("code, exit_code", [(0, 0), (3, 3)])
def test_the_watch_wakes_when_the_agent_ends_and_polls_no_more(counted_backend, tmp_path, code, exit_code):
    backend, checks = counted_backend
    thread, result = watch_in_thread(backend, [sys.executable, "-c", f"import time, sys; time.sleep(0.5); sys.exit({code})"],
                                     tmp_path)
    thread.join(120)  # an end that did not wake the watch would leave it asleep for the hour
    assert not thread.is_alive()
    assert result["outcome"].exit_code == exit_code
    assert len(checks) <= 3  # polling every poll_interval would have checked dozens of times


def test_a_stop_wakes_the_watch(counted_backend, tmp_path):
    backend, _ = counted_backend
    thread, result = watch_in_thread(backend, [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path)
    backend.terminate(grace=1.0)
    thread.join(120)
    assert not thread.is_alive()
    assert result["outcome"].stopped


def test_the_job_scan_finds_the_jobs_processes_and_no_other(tmp_path):
    from dtrain.launch.node.proctree import environ_of, job_processes

    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    ours = subprocess.Popen(sleeper, env=dict(os.environ, DTRAIN_JOB_ID="scan-1"))
    longer = subprocess.Popen(sleeper, env=dict(os.environ, DTRAIN_JOB_ID="scan-12"))  # the same bytes, and more
    try:
        assert [p.pid for p in job_processes("scan-1")] == [ours.pid]
        assert environ_of(longer.pid, needle=b"DTRAIN_JOB_ID=scan-1")["DTRAIN_JOB_ID"] == "scan-12"
        assert environ_of(longer.pid, needle=b"DTRAIN_JOB_ID=other") is None
    finally:
        for proc in (ours, longer):
            proc.kill()
            proc.wait()
