"""dtrain.launch.node.proctree stops a tree without taking its caller's exit statuses: the agents
report their rank's exit status from ``Popen.wait``, and that status must survive the stop."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest

from dtrain.launch.node.proctree import kill_tree, wait_gone

RANK = "import time; print('up', flush=True); time.sleep(600)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"


@pytest.fixture
def child():
    started: list[subprocess.Popen] = []

    def start(code: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout.readline() == "up\n"  # its handlers are in place
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("code, signum", [(RANK, signal.SIGTERM), (STUBBORN, signal.SIGKILL)])
def test_the_stopped_childs_status_is_left_for_its_popen(child, code, signum):
    proc = child(code)
    kill_tree(psutil.Process(), grace=0.5)
    # psutil.wait_procs reaped it here, and Popen.wait read ECHILD as exit status 0.
    assert proc.wait(timeout=10) == -signum


def test_wait_gone_counts_a_zombie_as_ended_and_leaves_it_to_its_parent(child):
    proc = child(RANK)
    victim = psutil.Process(proc.pid)
    assert wait_gone([victim], timeout=0.2) == [victim]  # alive: returned after the timeout
    proc.send_signal(signal.SIGTERM)
    assert wait_gone([victim], timeout=10) == []
    assert victim.status() == psutil.STATUS_ZOMBIE  # ended, not reaped
    assert proc.wait(timeout=10) == -signal.SIGTERM
