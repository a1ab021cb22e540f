"""The ssh remote agent's fence (dtrain.launch.backends.ssh.remote_agent), run here as the launcher runs it
on a host, without ssh: when its lease lapses (nothing on stdin for ``--lease`` seconds: the node is cut
off) it stops its ranks with the fence grace, not the stop grace. A rank cut off from its peers cannot
reach a checkpoint, and with the stop grace (30 s by default) the fence took the lease plus 30 s: the
issue's goal is no rank alive 60 s after the cut, with the default 30 s lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dtrain.launch.node.lease import FENCE_GRACE_S

#: a rank that saves on SIGTERM, as train_digits does: it ignores SIGTERM for its whole grace
STUBBORN_RANK = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                 "print('rank pid', os.getpid(), flush=True); time.sleep(600)")


@pytest.fixture
def agent(tmp_path):
    """The agent with a 1 s lease and a 60 s stop grace; its stdin stays open (the launcher's ssh client
    still connected, but silent: a partition). Everything it started is killed at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain.launch.backends.ssh.remote_agent", "--job-id", "dtrain-fence-test",
         "--node", "1", "--pgid-file", str(tmp_path / "node1.pgid"), "--grace", "60", "--lease", "1",
         "--", sys.executable, "-c", STUBBORN_RANK],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdin.write("{}\n")  # the environment line, then silence
    proc.stdin.flush()
    rank: list[int] = []
    yield proc, rank
    for pid in rank:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the agent made itself a process-group leader
    except ProcessLookupError:
        pass
    proc.stdin.close()
    proc.wait()


def test_a_cut_off_node_fences_its_ranks_with_the_fence_grace_not_the_stop_grace(agent, tmp_path):
    proc, rank = agent
    assert proc.stdout.readline().startswith("[dtrain-remote] nonce= node=1 pgid=")
    line = proc.stdout.readline()
    assert line.startswith("rank pid "), line
    rank.append(int(line.split()[-1]))
    # The stop grace is 60 s: an agent still waiting after 30 s did not use the fence grace.
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the fenced agent was still waiting for its rank after 30 s (fence grace {FENCE_GRACE_S} s)")
    assert code == 128 + signal.SIGKILL, code  # the agent exits with its rank's status: SIGKILLed
    with pytest.raises(ProcessLookupError):
        os.kill(rank[0], 0)
    assert "lease lapsed" in proc.stderr.read()
    assert (tmp_path / "fenced-node1").is_file()
