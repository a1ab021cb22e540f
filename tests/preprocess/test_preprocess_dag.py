"""Mapped preprocessing in real Airflow: one PreprocessOperator task per partition (dynamic task
mapping over three partitions), then the finalize task publishes the manifest (dag.test() on SQLite)."""

from __future__ import annotations

import json
import os

from tests.conftest import load_test_dag


def load_dag():
    return load_test_dag("preprocess_dags.py", "preprocess_mapped_test")


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
