"""A backend from outside this package: installed with pip (into a temporary target), found
through the ``dtrain.backends`` entry point, and held to the same contract. This is the proof
that a new backend is one folder (here one file) plus one entry-point line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from dtrain.launch.backends import backend_names, get_backend_class, reload_entry_points
from tests.launch.backends.contract import REPO, SCRIPT, BackendContract

TOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_pkg")


def test_without_the_entry_point_the_name_is_refused():
    from dtrain.errors import SpecError
    from dtrain.launch.core.spec import LaunchSpec

    assert "toy" not in backend_names()  # first in this file: before the module's install
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=[SCRIPT], backend="toy")
    assert err.value.field == "backend" and "local, ssh, slurm, mpi" in err.value.allowed


@pytest.fixture(scope="module")
def toy_installed(tmp_path_factory):
    """pip install the toy package into a target directory on sys.path; undone afterwards."""
    work = tmp_path_factory.mktemp("toy")
    source, target = work / "src", work / "site"
    shutil.copytree(TOY, source)  # the build writes beside its sources: keep it out of the repo
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(target), str(source)], check=True, timeout=300)
    sys.path.insert(0, str(target))
    reload_entry_points()
    try:
        yield str(target)
    finally:
        sys.path.remove(str(target))
        sys.modules.pop("dtrain_toy_backend", None)
        reload_entry_points()


class TestToyBackend(BackendContract):
    backend = "toy"

    @pytest.fixture
    def infra(self, toy_installed):
        yield toy_installed


def test_the_entry_point_makes_the_name_valid_everywhere(toy_installed, tmp_path):
    assert "toy" in backend_names()
    assert get_backend_class("toy").__module__ == "dtrain_toy_backend"
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": toy_installed, "OUT_DIR": str(out)}
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dtrain"), "launch", "--backend", "toy",
                           "--nodes", "2", "--procs-per-node", "1", "--run-dir", str(tmp_path / "run"), "--",
                           SCRIPT, "x"], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["rank0.json", "rank1.json"]
