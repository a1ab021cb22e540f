"""A successful mapped preprocessing run logs no error (dag.test() on SQLite, real Task SDK): the
finalize step reads what the mapped tasks returned in one request, where iterating Airflow's lazy
sequence asked for one item past the end and the SDK logged ``[error] XCom not found ... offset=N``."""

from __future__ import annotations

import os

from tests.conftest import load_test_dag

RECORDS_PER_PARTITION = 30


def small_partitions(digits_raw: str, folder) -> str:
    """Two partitions of the digits set, RECORDS_PER_PARTITION records each."""
    folder.mkdir()
    for name in sorted(n for n in os.listdir(digits_raw) if n.endswith(".jsonl"))[:2]:
        with open(os.path.join(digits_raw, name), encoding="utf-8") as fh:
            lines = [next(fh) for _ in range(RECORDS_PER_PARTITION)]
        (folder / name).write_text("".join(lines), encoding="utf-8")
    return str(folder)


def test_a_successful_mapped_run_logs_no_xcom_error(airflow_db, tmp_path, digits_raw, capfd):
    raw = small_partitions(digits_raw, tmp_path / "raw")
    dag_run = load_test_dag("preprocess_dags.py", "preprocess_mapped_test").test(
        run_conf={"raw": raw, "out": str(tmp_path / "dataset")})
    out, err = capfd.readouterr()
    tis = {(ti.task_id, ti.map_index): ti for ti in dag_run.get_task_instances()}
    assert {ti.state for ti in tis.values()} == {"success"}
    names = [tis[("preprocess", i)].xcom_pull(task_ids="preprocess", map_indexes=i)["name"] for i in (0, 1)]
    assert tis[("publish", -1)].xcom_pull(task_ids="publish")["partitions"] == names  # all of them, in order
    assert "XCom not found" not in out + err and "[error" not in out + err, (out + err)[-3000:]
