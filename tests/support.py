"""Helpers the test folders share: waiting for a condition, and which PIDs still run."""

from __future__ import annotations

import time

import psutil


def poll_until(predicate, timeout: float, interval: float = 0.1):
    """Poll ``predicate`` until it returns something truthy, for at most ``timeout`` seconds;
    returns its last value either way (for ``assert poll_until(...), details``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.1, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout``."""
    value = poll_until(predicate, timeout, interval)
    if not value:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    return value


def kill_survivors(procs, timeout: float) -> None:
    """SIGKILL whichever of ``procs`` (psutil.Process) still run after ``timeout`` seconds."""
    _, survivors = psutil.wait_procs(procs, timeout=timeout)
    for proc in survivors:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def alive(pids) -> list[int]:
    """PIDs still running (zombies count as gone: they hold nothing and cannot run)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def rank_records(out_dir) -> dict[int, dict]:
    """The ``rank<N>.json`` records a test script wrote (its env contract, argv, pid), by rank."""
    import json
    import os

    records = {}
    for name in os.listdir(out_dir):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as fh:
                record = json.load(fh)
            records[int(record["env"]["RANK"])] = record
    return records


HEAVY_LIBRARIES = frozenset({"torch", "deepspeed", "s3fs", "boto3", "botocore", "numpy", "matplotlib", "mlflow"})


def heavy_libraries_imported_by(*modules: str) -> list[str]:
    """The heavy libraries a fresh interpreter has imported after importing ``modules`` (DAG parsing
    and operator imports must stay cheap)."""
    import json
    import subprocess
    import sys

    code = (f"import json, sys; import {', '.join(modules)}; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return sorted(HEAVY_LIBRARIES & set(json.loads(out.stdout.strip().splitlines()[-1])))


def record_fsyncs(monkeypatch) -> list[str]:
    """Every ``os.fsync`` from now on, as "file" or "dir" in call order (each still syncs)."""
    import os
    import stat

    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return synced
