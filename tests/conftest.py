"""Suite-wide setup: an isolated AIRFLOW_HOME and DTRAIN_HOME, set before anything imports Airflow."""

from __future__ import annotations

import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_home = tempfile.mkdtemp(prefix="dtrain-tests-")
os.environ.setdefault("AIRFLOW_HOME", os.path.join(_home, "airflow"))
os.environ.setdefault("DTRAIN_HOME", os.path.join(_home, "dtrain"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", os.path.join(REPO, "dags"))
os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", os.path.join(REPO, "plugins"))
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "False")
# Two bundles: the product's dags/ and tests/dags/ (DAGs built for tests). dag.test() only runs
# DAGs that a bundle holds, so test DAGs live in files there and take their inputs as params.
os.environ.setdefault("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps([
    {"name": "dags-folder", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
     "kwargs": {"path": os.path.join(REPO, "dags")}},
    {"name": "test-dags", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
     "kwargs": {"path": os.path.join(REPO, "tests", "dags")}},
    {"name": "ui-test-dags", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
     "kwargs": {"path": os.path.join(REPO, "tests", "ui", "dags")}},
]))
os.environ.setdefault("PYTHONUNBUFFERED", "1")
# The venv's bin must be on PATH: launched ranks, `airflow` subcommands and `dtrain` run from it.
_bin = os.path.dirname(sys.executable)
if _bin not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")

import subprocess  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def airflow_db() -> str:
    """A migrated SQLite metadata DB in this session's AIRFLOW_HOME (for dag.test() and the CLI)."""
    home = os.environ["AIRFLOW_HOME"]
    marker = os.path.join(home, ".migrated")
    if not os.path.exists(marker):
        os.makedirs(home, exist_ok=True)
        subprocess.run([os.path.join(_bin, "airflow"), "db", "migrate"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
        open(marker, "w").close()
    return home


def load_test_dag(filename: str, dag_id: str, folder: str = os.path.join("tests", "dags")):
    """The DAG ``dag_id`` from <folder>/<filename>, ready for ``dag.test(run_conf=...)``."""
    import importlib.util

    path = os.path.join(REPO, folder, filename)
    spec = importlib.util.spec_from_file_location(f"test_dags_{filename[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for value in vars(module).values():
        if getattr(value, "dag_id", None) == dag_id and hasattr(value, "test"):
            return value
    raise LookupError(f"no DAG {dag_id!r} in {path}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, for the leftover check below."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def no_job_process_outlives_the_test(request):
    """A finalizer for every test: whatever a test started that carries a job id (ranks, agents,
    detached nodes, a rank's escaped children) is stopped when the test ends, pass or fail. A test
    that passed but left one fails: that is a leak of the product, not of the test. Only this
    session's jobs count (their run directories lie under its temp dirs): other runs on the
    machine are none of its business."""
    yield
    from dtrain.launch.proctree import kill_processes, processes_where

    ours = (str(request.config._tmp_path_factory.getbasetemp()), _home)
    left = processes_where(lambda environ: "DTRAIN_JOB_ID" in environ
                           and environ.get("DTRAIN_RUN_DIR", "").startswith(ours))
    if left:
        import psutil

        _, left = psutil.wait_procs(left, timeout=15)  # a job that just ended is still exiting
    if left:
        described = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left if p.is_running()]
        kill_processes(left, grace=5.0)
        call = getattr(request.node, "rep_call", None)
        if call is not None and call.passed and described:
            pytest.fail(f"processes of a job outlived the test (now stopped): {described}")
