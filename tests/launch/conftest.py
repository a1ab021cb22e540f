from __future__ import annotations

import os
import time

import psutil
import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def script(name: str) -> str:
    return os.path.join(SCRIPTS, name)


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def alive(pids) -> list[int]:
    """PIDs still running (zombies count as gone: they hold no resources and cannot run)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def out_dir(tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    return str(path)
