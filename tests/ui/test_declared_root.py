"""A run directory under a root that only the DAG's code names (the pipeline factory's ``shared_fs``,
whatever the API server's DTRAIN_SHARED_FS): shown, from the serialized DAG, never from XCom; the
launcher's marker is checked all the same."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import load_test_dag
from tests.ui.client import get, ti_query
from tests.ui.conftest import UI_DAGS


@pytest.fixture(scope="module")
def own_root_run(airflow_db):
    """A real 1-rank job of ui_own_root (tests/ui/dags/ui_dags.py), its run directory under the root
    its code declares; that root is removed at the end."""
    dag = load_test_dag("ui_dags.py", "ui_own_root", folder=UI_DAGS)
    root = dag.get_task("train").run_dir.split("/ui_own_root/")[0]  # <root>/ui_own_root/{{ ... }}/train
    try:
        run = dag.test()
        assert run.state == "success"
        yield run, root
    finally:
        shutil.rmtree(os.path.dirname(root), ignore_errors=True)


def test_a_run_under_the_root_its_dag_declares_is_shown(api, own_root_run):
    from dtrain.ui.provenance import runs_roots

    run, root = own_root_run
    assert not any(os.path.commonpath([configured, root]) == configured for configured in runs_roots())
    response = get(api, "/dtrain/api/ti/summary", ti_query(run, dag_id="ui_own_root"))
    assert response.status_code == 200, response.text
    view = response.json()
    assert view["state"] == "succeeded" and view["job"]["run_dir"].startswith(os.path.join(root, "ui_own_root") + "/")
    assert view["ranks_reporting"] == [0] and view["steps"] == 8
    svg = get(api, "/dtrain/api/ti/plot/loss.svg", ti_query(run, dag_id="ui_own_root"))
    assert svg.status_code == 200 and 'id="loss-rank0"' in svg.text


def test_an_edited_xcom_cannot_widen_the_declared_root(api, own_root_run, tmp_path):
    """The run record's XCom, PATCHed through the REST API, pointing elsewhere under the declared root
    (another DAG's folder) or at a copy outside it: refused, the marker and the DAG folder checked."""
    from dtrain.launch.core.job import RUN_RECORD_KEY
    from tests.ui.client import rest, xcom_entries
    from tests.ui.conftest import mark

    run, root = own_root_run
    path = xcom_entries("ui_own_root", run.run_id, "train", RUN_RECORD_KEY)
    original = rest(api, "GET", path).json()["value"]
    elsewhere = str(tmp_path / "ui_own_root" / "copy" / "train")
    another_dags = os.path.join(root, "ui_training", "copy", "train")
    try:
        for target in (elsewhere, another_dags):
            mark(target, "ui_own_root", run.run_id)  # a marker as good as the launcher's: the path decides
            response = rest(api, "PATCH", path, {"value": {**original, "run_dir": target}, "map_index": -1})
            assert response.status_code == 200, response.text
            refused = get(api, "/dtrain/api/ti/summary", ti_query(run, dag_id="ui_own_root"))
            assert refused.status_code == 404, target
            assert "not under the configured root" in refused.json()["detail"] or "folder" in refused.json()["detail"]
    finally:
        assert rest(api, "PATCH", path, {"value": original, "map_index": -1}).status_code == 200
        shutil.rmtree(os.path.join(root, "ui_training"), ignore_errors=True)


def test_the_pipeline_factory_declares_its_shared_fs_runs_in_the_serialized_dag():
    """What the API server reads: the factory's train task's run_dir, through Airflow's own serializer."""
    from airflow.serialization.serialized_objects import DagSerialization

    from dtrain.pipeline import DataConfig, GateConfig, TrainingConfig, retraining_pipeline
    from dtrain.ui.provenance import declared_root
    from dtrain.ui.store import _task_run_dirs

    dag = retraining_pipeline(
        "team_text",
        data=DataConfig(raw="s3://team/raw", processed="s3://team/processed", shared_fs="/fsx",
                        transform="team.data:features"),
        training=TrainingConfig(command=["python", "-c", "pass"]),
        gate=GateConfig(metric="perplexity", goal="minimize", evaluate="team.eval:evaluate"))
    run_dirs = _task_run_dirs(DagSerialization.to_dict(dag))
    assert declared_root(run_dirs["train"], "team_text") == "/fsx/runs"


@pytest.mark.parametrize("run_dir, root", [
    ("/fsx/runs/d/{{ params.v }}/run-{{ dag_run.clear_number }}", "/fsx/runs"),
    ("/fsx/runs/d", "/fsx/runs"),
    ("/data/d/d/{% if x %}a{% endif %}", "/data/d"),
    ("/fsx/runs/{{ dag.dag_id }}/x", None),  # the DAG's folder is not written out
    ("/d/{{ run_id }}", None),  # no root above the DAG's folder
    ("/fsx/../etc/d/x", None),
    ("runs/d/x", None),
    (None, None),
])
def test_the_declared_root_is_the_static_start_of_run_dir_up_to_the_dags_folder(run_dir, root):
    from dtrain.ui.provenance import declared_root

    assert declared_root(run_dir, "d") == root
