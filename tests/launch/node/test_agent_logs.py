"""The torchrun agent's private log directories (dtrain.launch.node.agent_logs): one whose agent was killed
is removed by the next agent on the host, and nothing else is: not a running agent's, not one of another
pid namespace, not a link or a file of that name, not a name of another shape. Then a real agent (a local
job with a temp folder of its own) removes a killed agent's directory and leaves none of its own."""

from __future__ import annotations

import os
import subprocess
import sys

from dtrain.launch.node import agent_logs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def gone_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_only_the_directories_of_agents_that_are_gone_are_removed(tmp_path):
    namespace, dead = agent_logs.pid_namespace(), gone_pid()
    killed = tmp_path / f"dtrain-agent-{namespace}-{dead}-abc_12"
    (killed / "attempt_0" / "0").mkdir(parents=True)
    (killed / "attempt_0" / "0" / "error.json").write_text("{}")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    (killed / "link").symlink_to(elsewhere)  # inside the directory: removed, not followed
    kept = {
        f"dtrain-agent-{namespace}-{os.getpid()}-running": "dir",      # a running agent's
        f"dtrain-agent-{int(namespace) + 1}-{dead}-otherns": "dir",    # another pid namespace's
        f"dtrain-agent-{namespace}-{dead}-alink": "link",              # a link planted with that name
        f"dtrain-agent-{namespace}-{dead}-afile": "file",
        f"dtrain-agent-{dead}-oldshape": "dir",
        f"torchelastic_{dead}": "dir",
    }
    for name, kind in kept.items():
        path = tmp_path / name
        if kind == "dir":
            path.mkdir()
        elif kind == "link":
            path.symlink_to(elsewhere)
        else:
            path.write_text("x")
    assert agent_logs.sweep(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "elsewhere"])
    assert (elsewhere / "keep").read_text() == "x"


def test_a_new_directory_is_named_for_this_agent_and_survives_a_sweep(tmp_path):
    made = agent_logs.make(str(tmp_path))
    match = agent_logs.NAME.match(os.path.basename(made))
    assert match and match.groups() == (agent_logs.pid_namespace(), str(os.getpid()))
    assert agent_logs.sweep(str(tmp_path)) == 0 and os.path.isdir(made)


def test_an_agent_removes_a_killed_agents_directory_and_leaves_none_of_its_own(tmp_path):
    tmp = tmp_path / "tmp"
    killed = tmp / f"dtrain-agent-{agent_logs.pid_namespace()}-{gone_pid()}-killed"
    (killed / "attempt_0").mkdir(parents=True)
    argv = [sys.executable, "-m", "dtrain.cli", "launch", "--device", "cpu", "--run-dir", str(tmp_path / "run"),
            "--nodes", "1", "--procs-per-node", "1", "--", "python", "-c", "pass"]
    env = dict(os.environ, TMPDIR=str(tmp), PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    run = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert os.listdir(tmp) == []
