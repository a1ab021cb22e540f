"""The registry's cheap look for third-party backends: importlib.metadata parses every installed
distribution only when one of them may declare the ``dtrain.backends`` group (test_toy.py installs one
that does, and finds it through this look)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from dtrain.launch.backends import ENTRY_POINT_GROUP, _group_may_be_declared


def dist(site, name: str, entry_points: str | None) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def path(monkeypatch, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [str(site), str(tmp_path / "missing")])
    return site


def test_distributions_of_other_groups_only_say_no(path):
    dist(path, "plain", None)
    dist(path, "tool", "[console_scripts]\ntool = tool:main\n[dtrain.backends.extra]\n")
    assert not _group_may_be_declared()


def test_a_distribution_declaring_the_group_says_maybe(path):
    dist(path, "plain", "[console_scripts]\nplain = plain:main\n")
    dist(path, "k8s_backend", f"[{ENTRY_POINT_GROUP}]\nk8s = k8s_backend:KubernetesBackend\n")
    assert _group_may_be_declared()


def test_an_egg_info_declaring_the_group_says_maybe(path):
    info = path / "old.egg-info"
    info.mkdir()
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nold = old:Backend\n")
    assert _group_may_be_declared()


@pytest.mark.parametrize("entry", ["zip", "egg"])
def test_what_it_cannot_list_says_maybe(path, monkeypatch, tmp_path, entry):
    if entry == "zip":
        archive = tmp_path / "bundle.zip"
        with zipfile.ZipFile(archive, "w") as zf:
            zf.writestr("bundle/__init__.py", "")
        monkeypatch.setattr(sys, "path", [str(path), str(archive)])
    else:
        (path / "legacy-1.0-py3.11.egg").mkdir()
    assert _group_may_be_declared()


def test_a_launch_of_a_builtin_backend_never_parses_the_installed_metadata():
    """This venv declares no dtrain.backends entry point: naming the backends and building `dtrain launch`'s
    parser import nothing of importlib.metadata."""
    code = ("import sys\n"
            "from dtrain.cli import build_parser\n"
            "from dtrain.launch.backends import backend_names\n"
            "build_parser([\"launch\"])\n"
            "print(backend_names(), 'importlib.metadata' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["('local',", "'ssh',", "'slurm',", "'mpi')", "False"], done.stdout
