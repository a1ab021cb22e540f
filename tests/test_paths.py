"""dtrain.paths: the one home of the runs roots and of run-directory names. The launcher, the training
operator, the pipeline factory and the UI's default runs roots all name directories through it, and
no other module spells the ``runs`` folder."""

from __future__ import annotations

import ast
import os

import pytest

import dtrain
from dtrain import paths


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRAIN_HOME", str(tmp_path / "home"))
    return str(tmp_path / "home")


def test_the_documented_layouts(home):
    assert paths.runs_root("/fsx") == "/fsx/runs"
    assert paths.job_run_dir("dtrain-abc") == f"{home}/runs/dtrain-abc"
    assert paths.task_run_dir("my dag", "manual__2026-01-01T00:00:00+00:00", "train/1") == (
        f"{home}/runs/my_dag/manual__2026-01-01T00_00_00_00_00/train_1")
    assert paths.pipeline_run_dir("/fsx", "tab", "v1", "2026-01-01", "3") == "/fsx/runs/tab/v1/2026-01-01/run-3"


def test_an_id_is_one_path_component():
    assert paths.safe_part("a/../b c") == "a_.._b_c"


@pytest.mark.parametrize("run_id", ["..", ".", "...", ""])
def test_a_run_id_of_dots_names_a_folder_of_its_own_under_the_dags(home, run_id):
    """Airflow takes ``..`` as a run id (anyone who may trigger the DAG picks it): the task's run directory
    must still lie under the DAG's folder, never beside it."""
    run_dir = paths.task_run_dir("dag", run_id, "train")
    dag_folder = os.path.join(home, "runs", "dag")
    assert os.path.dirname(os.path.dirname(os.path.normpath(run_dir))) == dag_folder, run_dir


def test_dtrain_home_defaults_to_a_folder_in_the_users_home(monkeypatch):
    monkeypatch.delenv("DTRAIN_HOME", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    assert paths.dtrain_home() == "/home/someone/.dtrain"


def test_a_job_without_a_run_dir_gets_its_run_directory_from_here(home):
    from dtrain.launch.core.job import prepare_job
    from dtrain.launch.core.spec import LaunchSpec

    job = prepare_job(LaunchSpec(command=["true"], job_id="dtrain-fixed"), create=False)
    assert job.run_dir == paths.job_run_dir("dtrain-fixed")


def test_the_operators_default_run_directory_comes_from_here(home):
    from dtrain.launch.airflow.operator import DistributedTrainingOperator

    op = DistributedTrainingOperator(task_id="train", command=["true"])
    assert op.default_run_dir({"run_id": "manual 1"}) == paths.task_run_dir(op.dag_id, "manual 1", "train")
    assert op.default_run_dir({}) == paths.task_run_dir(op.dag_id, "manual", "train")


def test_the_uis_default_runs_roots_are_the_roots_the_product_writes_under(home, monkeypatch):
    from dtrain.ui.provenance import runs_roots

    monkeypatch.setenv("DTRAIN_SHARED_FS", "/fsx")
    monkeypatch.delenv("AIRFLOW__DTRAIN__RUNS_ROOT", raising=False)
    assert runs_roots() == [paths.runs_root(home), paths.runs_root("/fsx")]


# -- the rule: the ``runs`` folder is spelled in dtrain.paths only ---------------------------------

def runs_spellings(package: str) -> list[str]:
    """"module:line" of each place the code joins ``runs`` into a path (URLs' ``/runs/`` are not paths)."""
    found = []
    for directory, _, files in os.walk(package):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), path)
            rel = os.path.relpath(path, package).replace(os.sep, "/")
            found += [f"{rel}:{arg.lineno}" for node in ast.walk(tree)
                      if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("path.join")
                      for arg in node.args if isinstance(arg, ast.Constant) and arg.value == paths.RUNS]
    return sorted(found)


def test_no_module_but_dtrain_paths_names_the_runs_folder():
    spelled = [where for where in runs_spellings(os.path.dirname(dtrain.__file__)) if not where.startswith("paths.py:")]
    assert not spelled, f"a runs root spelled outside dtrain.paths (use dtrain.paths.runs_root and friends): {spelled}"


def test_the_runs_scan_sees_a_planted_spelling(tmp_path):
    (tmp_path / "m.py").write_text(
        "import os, posixpath\n"
        "ROOT = os.path.join('/x', 'runs')\n"
        "FIELD = {'runs': []}\n"
        "def f(home):\n"
        "    return posixpath.join(home, 'runs', 'x')\n")
    assert runs_spellings(str(tmp_path)) == ["m.py:2", "m.py:5"]
