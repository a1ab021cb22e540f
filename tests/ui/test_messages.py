"""What the pages say, in Airflow's real app: a date skipped for lack of data, and the warm-up steps
the stall verdicts leave out."""

from __future__ import annotations

from tests.ui.client import get, rest, ti_query


def test_a_date_skipped_for_lack_of_data_says_so_not_failed(api, pipeline_run):
    pipeline_run("test_no_data", "2026-03-06T00:00:00+00:00", {})
    response = rest(api, "PATCH", "/dags/retrain_pipeline/dagRuns/test_no_data/taskInstances/list_raw_inputs",
                    {"new_state": "skipped"})  # as the task ends when the partition holds no file
    assert response.status_code == 200, response.text
    pipelines = get(api, "/dtrain/api/retraining").json()["pipelines"]
    row = next(r for p in pipelines if p["dag_id"] == "retrain_pipeline" for r in p["runs"] if r["run_id"] == "test_no_data")
    assert row["outcome"] == "skipped: no data"


def test_a_run_that_stopped_before_the_gate_with_data_still_says_failed(api, pipeline_run):
    pipeline_run("test_failed_early", "2026-03-07T00:00:00+00:00", {})
    assert rest(api, "PATCH", "/dags/retrain_pipeline/dagRuns/test_failed_early",
                {"state": "failed"}).status_code == 200
    pipelines = get(api, "/dtrain/api/retraining").json()["pipelines"]
    row = next(r for p in pipelines if p["dag_id"] == "retrain_pipeline" for r in p["runs"]
               if r["run_id"] == "test_failed_early")
    assert row["outcome"] == "failed before the gate"


def test_the_summary_names_the_warm_up_steps_the_verdicts_leave_out(api, failed_run):
    view = get(api, "/dtrain/api/ti/summary", ti_query(failed_run)).json()
    stall = view["stall"]
    assert stall["warmup_steps"] == 5
    logged = {0: 7, 1: 7}  # each rank logged steps 1..7 before rank 1 failed at step 8
    assert {r["rank"]: r["steps"] for r in stall["ranks"]} == {rank: n - 5 for rank, n in logged.items()}
