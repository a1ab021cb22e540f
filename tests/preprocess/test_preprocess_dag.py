"""Mapped preprocessing in real Airflow: one PreprocessOperator task per partition (dynamic task
mapping over three partitions), then the finalize task publishes the manifest (dag.test() on SQLite).
And the transform, which names code to run, is never rendered from a template."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import load_test_dag

MARKER_TRANSFORM = "tests.preprocess.prep_transforms:touch_marker"


def load_dag(dag_id: str = "preprocess_mapped_test"):
    return load_test_dag("preprocess_dags.py", dag_id)


def test_three_mapped_partitions_then_finalize(airflow_db, tmp_path, digits_raw):
    out = str(tmp_path / "dataset")
    dag_run = load_dag().test(run_conf={"raw": digits_raw, "out": out})
    tis = {(ti.task_id, ti.map_index): ti for ti in dag_run.get_task_instances()}
    mapped = sorted(k[1] for k in tis if k[0] == "preprocess")
    assert mapped == [0, 1, 2]  # one task instance per partition
    assert {ti.state for ti in tis.values()} == {"success"}

    summaries = [tis[("preprocess", i)].xcom_pull(task_ids="preprocess", map_indexes=i) for i in mapped]
    assert [s["records"] for s in summaries] == [479, 479, 479]
    assert len({s["name"] for s in summaries}) == 3
    published = tis[("publish", -1)].xcom_pull(task_ids="publish")
    assert published["num_samples"] == 1437 and published["partitions"] == [s["name"] for s in summaries]

    manifest = json.load(open(os.path.join(out, "manifest.json"), encoding="utf-8"))
    assert manifest["num_samples"] == 1437
    assert [p["name"] for p in manifest["source"]["partitions"]] == [s["name"] for s in summaries]
    assert len(manifest["shards"]) == 9 and {s["partition"] for s in manifest["shards"]} == {s["name"] for s in summaries}
    from dtrain.training.shards import ShardDataset

    assert len(ShardDataset(out, verify=True)) == 1437


def test_transform_chosen_by_a_param_is_not_rendered_and_the_task_refuses_it(airflow_db, tmp_path, digits_raw,
                                                                             monkeypatch, capfd):
    """The review's finding: transform was a templated field, so a DAG writing "{{ params.t }}" let
    whoever triggers the run (a UI user's conf) pick the code the task runs."""
    marker, out = tmp_path / "transform-ran", tmp_path / "dataset"
    monkeypatch.setenv("PREP_TEST_MARKER", str(marker))  # touch_marker leaves it if it ever runs
    raw = os.path.join(digits_raw, sorted(os.listdir(digits_raw))[0])
    dag_run = load_dag("preprocess_templated_transform_test").test(
        run_conf={"t": MARKER_TRANSFORM, "raw": raw, "out": str(out)})
    (ti,) = dag_run.get_task_instances()
    assert ti.state == "failed"
    logged = capfd.readouterr()
    assert "transform='{{ params.t }}' is invalid" in logged.out + logged.err  # refused as written, unrendered
    assert not marker.exists()  # the code the param named never ran
    assert not out.exists()  # refused before anything was created


def test_transform_is_not_a_templated_field():
    from dtrain.preprocess.operator import PreprocessFinalizeOperator, PreprocessOperator

    assert "transform" not in PreprocessOperator.template_fields
    assert "transform" not in PreprocessFinalizeOperator.template_fields
    assert {"input", "output_path", "max_record_bytes"} <= set(PreprocessOperator.template_fields)


@pytest.mark.parametrize("transform", ["{{ params.t }}", "{{params.t}}", "{% if true %}subprocess:call{% endif %}",
                                       "{# note #}subprocess:call", "mypkg.{{ params.m }}:fn"])
def test_execute_refuses_a_transform_template_before_anything_runs(tmp_path, digits_raw, monkeypatch, transform):
    from dtrain.errors import SpecError
    from dtrain.preprocess.operator import PreprocessOperator

    marker, out = tmp_path / "transform-ran", tmp_path / "out"
    monkeypatch.setenv("PREP_TEST_MARKER", str(marker))
    op = PreprocessOperator(task_id="p", transform=transform, input=digits_raw, output_path=str(out), workers="1")
    with pytest.raises(SpecError) as info:
        op.execute({"params": {"t": MARKER_TRANSFORM, "m": "x"}})
    assert info.value.field == "transform" and info.value.value == transform
    assert "never templated" in str(info.value) and "MODULE:FUNCTION" in str(info.value)
    assert not marker.exists() and not out.exists()


def test_a_literal_transform_still_runs(tmp_path, digits_raw, monkeypatch):
    from dtrain.preprocess.operator import PreprocessOperator

    marker = tmp_path / "transform-ran"
    monkeypatch.setenv("PREP_TEST_MARKER", str(marker))
    raw = os.path.join(digits_raw, sorted(os.listdir(digits_raw))[0])
    op = PreprocessOperator(task_id="p", transform=MARKER_TRANSFORM, input=raw, output_path=str(tmp_path / "out"),
                            workers="1")
    assert op.execute({})["samples"] == 479 and marker.exists()  # the marker does show when the code runs
