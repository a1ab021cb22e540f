"""Helpers for the SSH and MPI tests. Their two real sshd daemons on 127.0.0.1 (own ports, host
keys, AuthorizedKeysFile, StrictModes no, pid files in a temp dir) are the ``ssh_cluster``
fixture of tests/services.py.

Processes of a job are found by PID across "hosts" (all are on this machine): every
process whose environment carries the job's DTRAIN_JOB_ID or whose command line names
it (the remote agents and torchrun, which get the job env after they start).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import psutil
import pytest

from tests.support import poll_until

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "launch", "backends", "scripts", "ddp_train.py")

needs_sshd = pytest.mark.skipif(shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"),
                                reason="OpenSSH server not installed (scripts/apt-packages.txt: openssh-server)")
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="OpenMPI not installed (scripts/apt-packages.txt: openmpi-bin)")


def job_processes(job_id: str) -> list[psutil.Process]:
    """Every live process of the job, on every "host"."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == me:
            continue
        try:
            if job_id in " ".join(proc.info["cmdline"] or ()) or proc.environ().get("DTRAIN_JOB_ID") == job_id:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def still_alive(procs: list[psutil.Process]) -> list[str]:
    """Those of ``procs`` still running (is_running also checks the start time: no PID-reuse mix-up)."""
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            continue
    return out


def describe_job(job_id: str, limit: int = 120) -> list[str]:
    """Every live process of the job and every orted (they carry no job id), each with its
    state and command line, and py-spy's dump of the Python ones: what a stuck job is doing."""
    py_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    procs = job_processes(job_id) + [p for p in psutil.process_iter(["name"]) if p.info["name"] == "orted"]
    out: list[str] = []
    for proc in procs:
        try:
            out.append(f"[test] pid {proc.pid} ppid {proc.ppid()} {proc.status()}: {' '.join(proc.cmdline())[:200]}")
            if "python" not in proc.name() or not os.path.exists(py_spy):
                continue
            dump = subprocess.run([py_spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=30)
            out += ["[test]   " + line for line in (dump.stdout + dump.stderr).splitlines()[:limit]]
        except (psutil.Error, OSError, subprocess.TimeoutExpired) as e:
            out.append(f"[test] pid {proc.pid}: {e!r}")
    return out


def run_within(launcher, lines: list[str], seconds: float = 90.0):
    """``launcher.run()``, but a job still running after ``seconds`` (these take about 10 s) is
    described into ``lines`` (and printed: pytest shows it with a failure) and stopped, so the
    test fails on its own assertion with the launch log, not on pytest-timeout without it."""

    def expire() -> None:
        job = launcher.job
        found = [f"[test] the job still runs after {seconds:g} s; its processes:"]
        found += describe_job(job.job_id) if job is not None else ["[test] (no job was created)"]
        print("\n".join(found), flush=True)
        lines.extend(found)
        launcher.terminate()

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        return launcher.run()
    finally:
        timer.cancel()
        timer.join()


def wait_for(predicate, timeout: float, interval: float = 0.2):
    """Like tests.support.wait_for, but returns the last value instead of failing, so callers
    assert with their own details (the launch log)."""
    return poll_until(predicate, timeout, interval)


def reports(run_dir: str) -> dict[int, dict]:
    import json

    out = {}
    folder = os.path.join(run_dir, "reports")
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.startswith("rank") and name.endswith(".json"):
                with open(os.path.join(folder, name), encoding="utf-8") as fh:
                    out[int(name[4:-5])] = json.load(fh)
    return out


def train_command(*args: str) -> list[str]:
    return [sys.executable, TRAIN, *args]
