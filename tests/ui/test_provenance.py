"""XCom is not provenance: a Training tab shows a run directory only under the configured runs root, in its
DAG's folder, with the launcher's marker naming its task instance; the Retraining page uses a published
record only when it is its pipeline's for the run's partition. The attacks go through Airflow's real
REST API (a PATCH of the task's XCom) and the real API app; the other DAG's files are written as its
operator and publish task write them."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest

from dtrain.errors import SpecError
from dtrain.ui.provenance import Untrusted, marker_problem, runs_roots, trusted_published, trusted_run_dir
from dtrain.rundir import LOGS, MARKER, RunDir
from tests.ui.client import get, ti_query
from tests.ui.conftest import mark, runs_root

SECRET = "SECRET of dag_b"
TI = {"dag_id": "a", "run_id": "r1", "task_id": "train", "map_index": -1, "try_number": 2}


def write_job(path: str) -> None:
    """What a job leaves in its run directory: a log, a stack dump, metrics (each naming SECRET)."""
    run = RunDir(path)
    run.write(LOGS, "rank0.log", data=f"{SECRET}: step 1\n".encode())
    run.write("hang", "rank0.txt", data=f"Thread 1: {SECRET}\n".encode())
    run.write("metrics", "rank0.jsonl", data=(json.dumps({"step": 1, "loss": 0.5, SECRET: 1}) + "\n").encode())


@pytest.fixture
def dag_b_run_dir():
    """A job of another DAG (dag_b) in its own folder of the runs root, marked by its operator."""
    top = os.path.join(runs_root(), "dag_b")
    path = os.path.join(top, "manual__b", "train")
    try:
        mark(path, "dag_b", "manual__b")
        write_job(path)
        yield path
    finally:
        shutil.rmtree(top, ignore_errors=True)


FORGED = os.path.join("ui_training", "forged")  # below the runs root: where the forged directories go


def forged(kind: str, run_id: str, hung_dir: str, dag_b: str, tmp_path) -> tuple[str, str]:
    """A run directory to PATCH the failed run's record to, and the reason it must be refused."""
    mine = os.path.join(runs_root(), FORGED, "train")
    if kind == "another DAG's job":
        return dag_b, "not in DAG 'ui_training''s folder"
    if kind == "another run's job":
        return hung_dir, "its marker names run_id="
    if kind == "outside the runs root":
        path = str(tmp_path / "elsewhere" / "train")
        mark(path, "ui_training", run_id)  # even with a marker naming this very task instance
        write_job(path)
        return path, "not under the configured root"
    if kind == "a link on the way":
        # <runs>/ui_training/forged -> dag_b's folder, its marker rewritten to name this task
        # instance and this path: only the no-follow walk down from the root refuses it
        os.makedirs(os.path.join(runs_root(), "ui_training"), exist_ok=True)
        os.symlink(os.path.dirname(dag_b), os.path.dirname(mine))
        mark(dag_b, "ui_training", run_id, run_dir=mine)
        return mine, "symlink"
    write_job(mine)
    if kind == "no marker":
        return mine, f"no launcher's marker ({MARKER})"
    if kind == "a later try":
        mark(mine, "ui_training", run_id, try_number=99)
        return mine, "its marker names try 99"
    if kind == "a marker of another directory":
        mark(mine, "ui_training", run_id, run_dir=dag_b)
        return mine, "its marker names run_dir="
    raise AssertionError(kind)


@pytest.fixture
def forged_dirs():
    """Removes what :func:`forged` made, pass or fail."""
    path = os.path.join(runs_root(), FORGED)
    try:
        yield
    finally:
        if os.path.islink(path):
            os.unlink(path)
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("kind", ["another DAG's job", "outside the runs root", "another run's job",
                                  "a link on the way", "no marker", "a later try", "a marker of another directory"])
def test_a_patched_run_record_shows_nothing_of_a_directory_this_task_did_not_launch(
        api, failed_run, hung_run, patch_run_record, dag_b_run_dir, forged_dirs, tmp_path, kind):
    hung_dir = get(api, "/dtrain/api/ti/summary", ti_query(hung_run)).json()["job"]["run_dir"]
    run_dir, reason = forged(kind, failed_run.run_id, hung_dir, dag_b_run_dir, tmp_path)
    patch_run_record(run_dir)
    for path, extra in (("/dtrain/api/ti/logs", {}), ("/dtrain/api/ti/stack", {"rank": 0}),
                        ("/dtrain/api/ti/summary", {}), ("/dtrain/api/ti/curves", {}),
                        ("/dtrain/api/ti/plot/loss.svg", {})):
        # a_only may read ui_training's task instances, not dag_b's
        response = get(api, path, ti_query(failed_run) | extra, user=("a_only", "viewer"))
        assert response.status_code == 404, (path, response.status_code, response.text[:300])
        assert reason in response.json()["detail"], (path, response.json())
        assert SECRET not in response.text and "ui_train.py" not in response.text  # nor the hung job's stacks


def test_a_run_directory_made_a_link_after_its_check_is_refused_not_an_error(
        api, failed_run, own_run_dir, monkeypatch, tmp_path):
    from dtrain.ui import app as ui_app

    write_job(str(own_run_dir))
    check = ui_app.trusted_run_dir

    def checked_then_swapped(run_dir, ti, roots, declared=None):
        run = check(run_dir, ti, roots, declared)
        if not os.path.islink(run_dir):  # a rank renames its directory and leaves a link in its place
            os.rename(run_dir, tmp_path / "moved")
            os.symlink(tmp_path / "moved", run_dir)
        return run

    monkeypatch.setattr(ui_app, "trusted_run_dir", checked_then_swapped)
    for path in ("/dtrain/api/ti/logs", "/dtrain/api/ti/summary"):
        response = get(api, path, ti_query(failed_run))
        assert response.status_code == 404 and "symlink" in response.json()["detail"], response.text[:300]
        assert SECRET not in response.text


def test_the_launcher_marks_the_run_directory_with_its_task_instance(api, failed_run):
    view = get(api, "/dtrain/api/ti/summary", ti_query(failed_run)).json()
    run_dir = view["job"]["run_dir"]
    assert run_dir.startswith(os.path.join(runs_root(), "ui_training") + os.sep)
    assert RunDir(run_dir).read_json(MARKER) == {
        "dag_id": "ui_training", "run_id": failed_run.run_id, "task_id": "train", "map_index": -1,
        "try_number": view["ti"]["try_number"], "run_dir": run_dir}


# -- the published record --------------------------------------------------------------------------

def models_root() -> str:
    from dtrain.ui.provenance import models_roots

    return models_roots()[0]


def publish_record(pipeline: str, partition: str, rmse: float, approver: str, where: str | None = None) -> str:
    """A metrics.json as dtrain.pipeline.publish writes it; its path."""
    directory = where or os.path.join(models_root(), pipeline, "v1", partition)
    record = {"pipeline": pipeline, "dataset_version": "v1", "partition": partition, "evaluation": {"rmse": rmse},
              "approval": {"chosen_options": ["Approve"], "responded_by": approver}}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "metrics.json"), "w") as fh:
        json.dump(record, fh)
    return os.path.join(directory, "metrics.json")


@pytest.fixture
def published_models(tmp_path):
    """Records of the pipeline (retrain_pipeline, 2026-03-02) and of another (dag_b), and copies of
    dag_b's where the pipeline's would be and outside the models root. Removed at the end."""
    try:
        yield {
            "own": publish_record("retrain_pipeline", "2026-03-02", 0.25, "alice"),
            "another pipeline's": publish_record("dag_b", "2026-03-02", 0.01, SECRET),
            "another partition's": publish_record("retrain_pipeline", "2026-03-01", 0.01, SECRET),
            "outside the models root": publish_record("retrain_pipeline", "2026-03-02", 0.01, SECRET,
                                                      where=str(tmp_path / "retrain_pipeline" / "v1" / "2026-03-02")),
        }
    finally:
        for pipeline in ("retrain_pipeline", "dag_b"):
            shutil.rmtree(os.path.join(models_root(), pipeline), ignore_errors=True)


@pytest.mark.parametrize("which, used", [("own", True), ("another pipeline's", False), ("another partition's", False),
                                         ("outside the models root", False)])
def test_the_retraining_page_uses_only_the_pipelines_own_record_for_the_runs_partition(
        api, pipeline_run, published_models, which, used):
    decision = {"metric": "rmse", "goal": "minimize", "publish": True, "value": 0.5, "baseline": None, "reasons": []}
    pipeline_run("test_published", "2026-03-02T00:00:00+00:00", {
        ("gate", "decision"): decision,
        ("publish", "return_value"): {"metrics_path": published_models[which], "model_path": "/models/m.pt"}})
    response = get(api, "/dtrain/api/retraining")
    assert response.status_code == 200
    pipeline = next(p for p in response.json()["pipelines"] if p["dag_id"] == "retrain_pipeline")
    row = next(r for r in pipeline["runs"] if r["run_id"] == "test_published")
    assert row["outcome"] == "published"
    assert (row["value"], row["approval"]) == ((0.25, {"chosen_options": ["Approve"], "responded_by": "alice"})
                                               if used else (0.5, None))
    assert SECRET not in response.text


# -- the checks themselves -------------------------------------------------------------------------

def test_a_marker_vouches_only_for_its_own_task_instance_directory_and_a_try_up_to_the_current():
    marker = {**TI, "run_dir": "/runs/a/r1/train"}
    assert marker_problem(marker, TI, "/runs/a/r1/train") is None
    assert marker_problem({**marker, "try_number": 1}, TI, "/runs/a/r1/train") is None  # a retry not started yet
    for change, problem in (({"try_number": 3}, "try 3"), ({"try_number": 0}, "try 0"), ({"try_number": True}, "try"),
                            ({"try_number": "2"}, "try"), ({"run_id": "r2"}, "run_id='r2'"),
                            ({"map_index": 0}, "map_index=0"), ({"map_index": -1.0}, "map_index=-1.0"),
                            ({"task_id": "eval"}, "task_id"), ({"dag_id": "b"}, "dag_id"),
                            ({"run_dir": "/runs/b/r1/train"}, "run_dir")):
        assert problem in marker_problem({**marker, **change}, TI, "/runs/a/r1/train"), change
    assert "no launcher's marker" in marker_problem(None, TI, "/runs/a/r1/train")
    assert "no launcher's marker" in marker_problem(["a"], TI, "/runs/a/r1/train")


@pytest.mark.parametrize("run_dir, reason", [
    ("/elsewhere/a/r1/train", "not under the configured root"),
    ("/runs", "not under the configured root"),
    ("/runs/../etc/a", "not under the configured root"),
    ("/runs2/a/r1", "not under the configured root"),  # a prefix of the path, not a parent
    ("relative/a/r1", "not under the configured root"),
    (None, "not under the configured root"),
    ("/runs/b/r1/train", "not in DAG 'a''s folder"),
    ("/runs/a/r1\0/train", "not an absolute, normalized path"),
])
def test_a_run_dir_must_lie_in_its_dags_folder_of_a_runs_root(run_dir, reason):
    with pytest.raises(Untrusted, match=reason.replace("(", r"\(")):
        trusted_run_dir(run_dir, TI, ["/runs", "/fsx/runs"])


def test_every_component_from_the_root_is_opened_without_following_links(tmp_path):
    root = tmp_path / "runs"
    real = tmp_path / "elsewhere" / "r1" / "train"
    mark(str(real), "a", "r1", try_number=2, run_dir=str(root / "a" / "r1" / "train"))
    (root / "a").mkdir(parents=True)
    os.symlink(real.parent, root / "a" / "r1")
    with pytest.raises(Untrusted, match="symlink"):
        trusted_run_dir(str(root / "a" / "r1" / "train"), TI, [str(root)])
    os.unlink(root / "a" / "r1")
    shutil.move(str(real.parent), str(root / "a" / "r1"))
    assert trusted_run_dir(str(root / "a" / "r1" / "train"), TI, [str(root)]).path == str(root / "a" / "r1" / "train")
    os.symlink(root, tmp_path / "fsx")  # a configured root may itself be a link (/fsx -> the mount)
    linked = str(tmp_path / "fsx" / "a" / "r1" / "train")
    mark(linked, "a", "r1", try_number=2)
    assert trusted_run_dir(linked, TI, [str(tmp_path / "fsx")]).path == linked


def test_a_published_record_must_name_its_pipeline_version_and_partition(tmp_path):
    root = tmp_path / "models"

    def write(record, *parts):
        path = root.joinpath(*parts, "metrics.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        return str(path)

    good = {"pipeline": "p", "dataset_version": "v1", "partition": "2026-03-02", "evaluation": {"rmse": 1}}
    path = write(good, "p", "v1", "2026-03-02")
    assert trusted_published(path, "p", "2026-03-02", [str(root)]) == good
    for record, parts, partition, reason in (
            (good, ("p", "v1", "2026-03-02"), "2026-03-03", "is not"),
            ({**good, "pipeline": "q"}, ("p", "v1", "2026-03-02"), "2026-03-02", "its record names"),
            ({**good, "dataset_version": "v2"}, ("p", "v1", "2026-03-02"), "2026-03-02", "its record names"),
            (good, ("q", "v1", "2026-03-02"), "2026-03-02", "is not"),
            (good, ("p", "v1", "x", "2026-03-02"), "2026-03-02", "is not"),
            ([good], ("p", "v1", "2026-03-02"), "2026-03-02", "not a readable record")):
        with pytest.raises(Untrusted, match=reason):
            trusted_published(write(record, *parts), "p", partition, [str(root)])
    with pytest.raises(Untrusted, match="not under the configured root"):
        trusted_published(path, "p", "2026-03-02", [str(tmp_path / "other")])


def test_the_roots_come_from_airflow_config_and_default_to_where_the_product_writes(monkeypatch):
    monkeypatch.delenv("AIRFLOW__DTRAIN__RUNS_ROOT", raising=False)
    monkeypatch.setenv("DTRAIN_SHARED_FS", "/fsx")
    assert runs_roots() == [os.path.join(os.environ["DTRAIN_HOME"], "runs"), "/fsx/runs"]
    monkeypatch.setenv("AIRFLOW__DTRAIN__RUNS_ROOT", "/lustre/runs:/scratch/runs")
    assert runs_roots() == ["/lustre/runs", "/scratch/runs"]
    for bad in ("runs", "/lustre/../runs", "/lustre/runs/", "/a::/b"):
        monkeypatch.setenv("AIRFLOW__DTRAIN__RUNS_ROOT", bad)
        with pytest.raises(SpecError, match=r"\[dtrain\] runs_root="):
            runs_roots()


def test_a_marker_written_by_the_operator_replaces_a_planted_link_and_never_writes_through_it(tmp_path):
    from dtrain.rundir import write_marker

    victim = tmp_path / "victim"
    victim.write_text("intact")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(victim, run / MARKER)
    write_marker(str(run), SimpleNamespace(dag_id="a", run_id="r1", task_id="train", map_index=None, try_number=2))
    assert victim.read_text() == "intact" and not os.path.islink(run / MARKER)
    assert marker_problem(RunDir(str(run)).read_json(MARKER), TI, str(run)) is None
