"""Airflow with the regularly installed dtrain, and a DAGs folder and a plugins folder that each hold
the user's own ``operators`` package: the repo's DAGs and plugin and a user's DAG parse cleanly.

One-shot CLI commands of the fresh venv against a fresh AIRFLOW_HOME (SQLite):
``airflow db migrate``, ``airflow dags reserialize`` (parses the dags-folder bundle, records
import errors), ``airflow dags list-import-errors -o json``, ``airflow dags list -o json``.
A deliberately broken DAG file proves that the import-error check sees errors.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest

from .conftest import REPO, copy_project, run, venv_env

REPO_DAG_IDS = {"retrain_pipeline", "evaluate_published_model", "ddp_demo"}
USER_DAG_ID = "user_dag_with_own_operators"
BROKEN = "broken_dag.py"


def parse_json_output(proc) -> list:
    """The JSON document a CLI printed with ``-o json`` (log lines may come before it on stdout)."""
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(("[{", "[]", "{")):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise AssertionError(f"no JSON in stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def airflow(fresh_install):
    """A parsed Airflow project: (env, project folder, CLI runner)."""
    project = fresh_install.path("airflow_project")
    copy_project("airflow", project)
    dags, plugins = os.path.join(project, "dags"), os.path.join(project, "plugins")
    for path in glob.glob(os.path.join(REPO, "dags", "*.py")):
        shutil.copy(path, dags)
    shutil.copy(os.path.join(REPO, "plugins", "dtrain_plugin.py"), plugins)
    env = venv_env(
        fresh_install,
        AIRFLOW_HOME=os.path.join(project, "home"),
        AIRFLOW__CORE__DAGS_FOLDER=dags,
        AIRFLOW__CORE__PLUGINS_FOLDER=plugins,
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__UNIT_TEST_MODE="False",
        DTRAIN_SHARED_FS=os.path.join(project, "shared"),
    )
    os.makedirs(env["AIRFLOW_HOME"])

    def airflow_cli(*args, timeout=120, check=True):
        return run(["airflow", *args], env=env, cwd=project, timeout=timeout, check=check)

    airflow_cli("db", "migrate", timeout=240)
    airflow_cli("dags", "reserialize", timeout=180)
    return env, project, airflow_cli


def test_only_the_deliberately_broken_dag_has_an_import_error(airflow):
    _, _, airflow_cli = airflow
    proc = airflow_cli("dags", "list-import-errors", "-o", "json", check=False)
    errors = parse_json_output(proc)
    files = sorted(os.path.basename(e["filepath"]) for e in errors)
    assert files == [BROKEN], json.dumps(errors, indent=1)[-6000:]
    assert proc.returncode == 1  # the command flags import errors with its exit status
    assert "deliberately broken DAG file" in errors[0]["error"]


def test_repo_dags_and_the_user_dag_are_listed(airflow):
    _, project, airflow_cli = airflow
    # `dags list` also exits non-zero to flag the (deliberate) import error; its JSON is complete.
    proc = airflow_cli("dags", "list", "-o", "json", check=False)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    dags = {d["dag_id"]: d for d in parse_json_output(proc)}
    assert REPO_DAG_IDS | {USER_DAG_ID} <= set(dags), sorted(dags)
    assert os.path.basename(dags[USER_DAG_ID]["fileloc"]) == "user_dag.py"
    assert {os.path.dirname(d["fileloc"]) for d in dags.values()} == {os.path.join(project, "dags")}


def test_plugins_and_provider_load_from_the_installed_package(airflow, fresh_install):
    env, project, _ = airflow
    code = (
        "import json\n"
        "from airflow import plugins_manager as pm\n"
        "from airflow.providers_manager import ProvidersManager\n"
        "info = pm.get_plugin_info()\n"
        "provider = ProvidersManager().providers.get('airflow-dtrain')\n"
        "print(json.dumps({'plugins': [[p.get('name'), str(p.get('source'))] for p in info],\n"
        "                  'errors': pm.get_import_errors(),\n"
        "                  'provider': provider.data.get('package-name') if provider else None}))\n")
    proc = run([fresh_install.python, "-c", code], env=env, cwd=project, timeout=120, check=True)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    names = [name for name, _ in seen["plugins"]]
    assert seen["errors"] == {}, seen
    assert names.count("dtrain") == 1 and "user_plugin" in names, seen
    assert seen["provider"] == "airflow-dtrain", seen
