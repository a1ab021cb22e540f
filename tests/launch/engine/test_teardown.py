"""No orphan, ever: a failing rank, SIGTERM/SIGINT to the launcher, SIGKILL of the launcher and on_kill
each leave no process of the job alive (checked by PID)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher

from ..conftest import alive, script, wait_for

DTRAIN = os.path.join(os.path.dirname(sys.executable), "dtrain")


def rank_pids(out_dir, world):
    def read():
        names = [n for n in os.listdir(out_dir) if n.startswith("pid")]
        if len(names) < world:
            return None
        return [int(open(os.path.join(out_dir, n)).read()) for n in names]
    return read


def test_failing_rank_tears_down_every_rank_and_propagates_its_exit_code(out_dir):
    lines = []
    spec = LaunchSpec(command=[script("fail_rank.py")], nodes=2, procs_per_node=2,
                      env={"OUT_DIR": out_dir, "FAIL_RANK": "3", "FAIL_CODE": "7"})
    launcher = Launcher(spec, sink=lines.append)
    seen: set[int] = set()
    done = threading.Event()

    def watch():  # remember every process of the job while it runs (agents, wrappers, ranks)
        while not done.is_set():
            seen.update(launcher.backend.pids())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    result = launcher.run()
    elapsed = time.monotonic() - started
    done.set()
    watcher.join()
    pids = {int(n[3:]): int(open(os.path.join(out_dir, n)).read()) for n in os.listdir(out_dir) if n.startswith("pid")}
    assert result.exit_code == 7 and result.failed_rank == 3, lines[-20:]
    assert "rank failing on purpose" in result.tail
    # The hanging ranks were watched (rank 3 may exit between two looks: it is checked below).
    assert {pids[r] for r in (0, 1, 2)} <= seen and len(seen) >= 2 + 3  # 2 agents + the hanging ranks
    assert alive(seen | set(pids.values())) == []
    assert elapsed < 120  # the hanging ranks sleep 600 s: they were torn down, not waited for


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_leaves_no_pid(out_dir, signum):
    proc = subprocess.Popen([DTRAIN, "launch", "--nodes", "2", "--procs-per-node", "2", "--env", f"OUT_DIR={out_dir}",
                             "--", script("fail_rank.py")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids = wait_for(rank_pids(out_dir, 4), timeout=120, what="all ranks up")
    tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert set(pids) <= set(tree)
    proc.send_signal(signum)
    code = proc.wait(timeout=60)
    assert code == 143
    wait_for(lambda: not alive(tree), timeout=15, what="every process of the job to exit")


def test_sigkill_of_launcher_leaves_no_pid(out_dir):
    # The launcher gets no chance to clean up: the kernel's parent-death signal does it.
    proc = subprocess.Popen([DTRAIN, "launch", "--nodes", "2", "--procs-per-node", "1", "--env", f"OUT_DIR={out_dir}",
                             "--", script("fail_rank.py")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(rank_pids(out_dir, 2), timeout=120, what="all ranks up")
    tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.kill()
    proc.wait()
    wait_for(lambda: not alive(tree), timeout=30, what="every process of the job to exit")


def test_failed_launch_cli_exit_code_is_the_ranks(out_dir):
    proc = subprocess.run([DTRAIN, "launch", "--nodes", "1", "--procs-per-node", "2", "--env", f"OUT_DIR={out_dir}",
                           "--env", "FAIL_RANK=0", "--env", "FAIL_CODE=42", "--", script("fail_rank.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 42, proc.stderr[-2000:]
    assert "rank failing on purpose" in proc.stderr


def test_a_failed_node_reports_its_last_lines_even_when_its_reader_lags():
    """The node exits before its reader thread has read its last lines (here a slow sink holds the
    reader back): the failure must still carry them, since they say why it failed."""
    from dtrain.launch.core.processes import NodeSupervisor

    def slow_sink(line: str) -> None:
        time.sleep(0.5)

    supervisor = NodeSupervisor(slow_sink)
    code = "print('starting', flush=True); print('the reason it failed', flush=True); raise SystemExit(3)"
    try:
        supervisor.start([[sys.executable, "-c", code]], [dict(os.environ)])
        exit_code, node = supervisor.wait(expected=1)
        assert exit_code == 3 and list(node.tail) == ["starting", "the reason it failed"]
    finally:
        supervisor.teardown()


def test_a_rank_that_aborts_in_native_code_reports_where_it_was():
    """A rank killed by SIGABRT (a collective library's std::terminate, say) prints no traceback of
    its own: the wrapper turns on Python's fault handler for it, so the tail names the frame."""
    code = "import os\ndef in_the_training_step():\n    os.abort()\nin_the_training_step()\n"
    proc = subprocess.run([DTRAIN, "launch", "--nodes", "1", "--procs-per-node", "1", "--",
                           sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 134, proc.stderr[-2000:]
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr[-2000:]
    assert "in_the_training_step" in proc.stderr.split("last lines of rank 0:")[-1], proc.stderr[-2000:]
