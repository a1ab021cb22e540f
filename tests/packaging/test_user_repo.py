"""A training repository with its own ``operators`` package, launched by the regularly installed dtrain.

With the package named ``operators``, ``python -m operators.launch.rank_entry`` (what every
torchrun agent starts, in the user's working directory) found the user's ``operators`` first
and every rank failed. The package is now ``dtrain``; these run the real ``dtrain launch``
(torchrun agents and ranks) of the fresh venv from such a repository.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from tests.support import rank_records

from .conftest import copy_project, run, venv_env, wait_no_processes_of

USER_MARKER = "user-operators-package"


@pytest.fixture
def user_repo(fresh_install, tmp_path):
    return copy_project("userrepo", str(tmp_path / "userrepo"))


def test_user_operators_and_dtrain_import_side_by_side(fresh_install, user_repo):
    code = ("import json, operators, operators.helpers, dtrain, dtrain.launch.node.rank_entry; "
            "print(json.dumps([operators.helpers.MARKER, operators.__file__, dtrain.__file__]))")
    proc = run([fresh_install.python, "-c", code], env=venv_env(fresh_install), cwd=user_repo, timeout=60)
    assert proc.returncode == 0, proc.stderr
    marker, operators_file, dtrain_file = json.loads(proc.stdout)
    assert marker == USER_MARKER
    assert operators_file == os.path.join(user_repo, "operators", "__init__.py")
    assert dtrain_file.startswith(fresh_install.site_packages + os.sep)


def test_rank_entry_module_runs_from_a_repo_with_its_own_operators(fresh_install, user_repo, tmp_path):
    """What a torchrun agent starts on each rank, run directly in the user's repository."""
    out = tmp_path / "out"
    out.mkdir()
    env = venv_env(fresh_install, OUT_DIR=str(out), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                   LOCAL_WORLD_SIZE="1", GROUP_RANK="0", DTRAIN_RUN_DIR=str(tmp_path / "run"))
    proc = run([fresh_install.python, "-m", "dtrain.launch.node.rank_entry", "python", "train.py"],
               env=env, cwd=user_repo, timeout=60)
    assert proc.returncode == 0, proc.stderr
    record = rank_records(str(out))[0]
    assert record["marker"] == USER_MARKER and record["env"]["NODE_RANK"] == "0"
    assert record["helpers_file"] == os.path.join(user_repo, "operators", "helpers.py")

    # The mechanism that broke the old name: in this directory `operators` is the user's package,
    # so an entry point spelled `-m operators.launch.rank_entry` cannot be found.
    proc = run([fresh_install.python, "-m", "operators.launch.rank_entry", "python", "train.py"],
               env=env, cwd=user_repo, timeout=60)
    assert proc.returncode != 0
    assert "No module named 'operators.launch'" in proc.stderr, proc.stderr


@pytest.mark.parametrize("nodes, procs, command", [
    (1, 2, ["python", "train.py"]),
    (2, 2, ["python", "train.py"]),
    (1, 2, ["python", "-m", "operators.job"]),
], ids=["1x2-script", "2x2-script", "1x2-module"])
def test_dtrain_launch_from_a_repo_with_its_own_operators(fresh_install, user_repo, tmp_path, nodes, procs, command):
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    proc = run(["dtrain", "launch", "--nodes", str(nodes), "--procs-per-node", str(procs),
                "--run-dir", str(run_dir), "--env", f"OUT_DIR={out}", "--", *command],
               env=venv_env(fresh_install), cwd=user_repo, timeout=150)
    log = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, log
    leftovers = wait_no_processes_of(fresh_install)
    assert not leftovers, f"processes left after the launch: {leftovers}"

    world = nodes * procs
    records = rank_records(str(out))
    assert sorted(records) == list(range(world)), log
    mode = "module" if "-m" in command else "script"
    for rank, record in records.items():
        env = record["env"]
        assert record["marker"] == USER_MARKER and record["mode"] == mode
        assert record["helpers_file"] == os.path.join(user_repo, "operators", "helpers.py")
        assert record["cwd"] == user_repo
        assert record["executable"] == fresh_install.python
        assert env["WORLD_SIZE"] == str(world) and env["LOCAL_WORLD_SIZE"] == str(procs)
        assert env["NODE_RANK"] == str(rank // procs) and env["LOCAL_RANK"] == str(rank % procs)
        # each rank was wrapped by the installed dtrain's rank_entry, run by the fresh interpreter
        parent = record["parent_cmdline"]
        assert parent[:3] == [fresh_install.python, "-m", "dtrain.launch.node.rank_entry"], parent
    exits = glob.glob(os.path.join(run_dir, "exits", "rank*.json"))
    assert len(exits) == world, exits
