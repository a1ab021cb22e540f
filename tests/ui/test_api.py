"""The Training tab's JSON API and pages, in Airflow's real API server app, over real jobs' run directories:
what a failed and a hung job show, and who may see them (Airflow's own security dependencies)."""

from __future__ import annotations

import os

import pytest

from tests.ui.client import get, ti_query

ENDPOINTS = ["/dtrain/ti", "/dtrain/api/ti/summary", "/dtrain/api/ti/curves", "/dtrain/api/ti/logs",
             "/dtrain/api/ti/plot/loss.svg"]


def run_dir_of(api, run) -> str:
    return get(api, "/dtrain/api/ti/summary", ti_query(run)).json()["job"]["run_dir"]


def test_a_failed_job_names_the_rank_with_its_tail_verdicts_and_checkpoint(api, failed_run):
    view = get(api, "/dtrain/api/ti/summary", ti_query(failed_run)).json()
    assert view["state"] == "failed" and view["ti"]["state"] == "failed"
    assert view["job"]["backend"] == "local" and view["job"]["world_size"] == 2
    failure = view["failure"]
    assert (failure["rank"], failure["exit_code"]) == (1, 3)
    assert failure["tail"][-1] == "step 8: RuntimeError: rank 1 hit a bad batch"
    assert view["hang"] is None and view["result"] is None
    cpu = view["stall"]["rules"]["CPUBottleneck"]
    assert cpu["triggered"] and cpu["ranks"] == [1]  # rank 1 waits 3x longer for each batch
    assert [c["step"] for c in view["checkpoints"]] == [5] and view["checkpoints"][0]["size_bytes"] > 0
    assert view["steps"] == 7 and view["ranks_reporting"] == [0, 1]


def test_curves_give_every_rank_every_step_and_since_step_only_the_new_ones(api, failed_run):
    curves = get(api, "/dtrain/api/ti/curves", ti_query(failed_run)).json()["curves"]
    assert set(curves) == {"loss", "samples_per_s", "data_wait_fraction"}
    for name, by_rank in curves.items():
        assert sorted(by_rank) == ["0", "1"], name
        assert [p[0] for p in by_rank["1"]] == list(range(1, 8)), name
    assert min(p[1] for p in curves["data_wait_fraction"]["1"]) > 0.5 > max(p[1] for p in curves["data_wait_fraction"]["0"])
    newer = get(api, "/dtrain/api/ti/curves", ti_query(failed_run) | {"since_step": 5}).json()["curves"]
    assert [p[0] for p in newer["loss"]["0"]] == [6, 7]


def test_each_rank_has_its_own_log_tail(api, failed_run):
    tails = get(api, "/dtrain/api/ti/logs", ti_query(failed_run) | {"lines": 5}).json()["tails"]
    assert sorted(tails) == ["0", "1"]
    assert all(len(lines) == 5 for lines in tails.values())
    assert tails["1"][-1] == "step 8: RuntimeError: rank 1 hit a bad batch"
    assert not any("bad batch" in line for line in tails["0"])  # rank 0's own output only


def test_plots_are_svg_with_one_series_per_rank(api, failed_run):
    for curve in ("loss", "samples_per_s", "data_wait_fraction"):
        response = get(api, f"/dtrain/api/ti/plot/{curve}.svg", ti_query(failed_run))
        assert response.status_code == 200 and response.headers["content-type"].startswith("image/svg+xml")
        svg = response.text
        assert svg.startswith("<svg") and f'id="{curve}-rank0"' in svg and f'id="{curve}-rank1"' in svg
        assert f'id="{curve}-rank2"' not in svg


def test_the_page_carries_the_task_instance_and_a_strict_content_security_policy(api, failed_run):
    response = get(api, "/dtrain/ti", ti_query(failed_run))
    assert response.status_code == 200
    assert f'data-run_id="{failed_run.run_id}"' in response.text and 'data-map_index="-1"' in response.text
    assert '<script src="/dtrain/static/training.js">' in response.text
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'self'" in csp
    assert get(api, "/dtrain/static/training.js").headers["content-type"].startswith("text/javascript")


def test_a_hung_job_names_the_stuck_rank_and_links_every_stack(api, hung_run):
    view = get(api, "/dtrain/api/ti/summary", ti_query(hung_run)).json()
    assert view["state"] == "hung"
    assert view["hang"]["stuck_ranks"] == [1] and view["hang"]["timeout_s"] == 8
    assert "rank(s) 1 stuck" in view["hang"]["message"]
    assert view["stacks"] == [0, 1]
    stack = get(api, "/dtrain/api/ti/stack", ti_query(hung_run) | {"rank": 1})
    assert stack.status_code == 200 and stack.headers["content-type"].startswith("text/plain")
    assert "ui_train.py" in stack.text  # the stuck rank's own frames
    assert get(api, "/dtrain/api/ti/stack", ti_query(hung_run) | {"rank": 7}).status_code == 404


# -- security ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ENDPOINTS + ["/dtrain/retraining", "/dtrain/api/retraining",
                                              "/dtrain/static/training.js"])
def test_no_token_is_401_and_a_forged_one_403(api, failed_run, path):
    assert get(api, path, ti_query(failed_run), user=None).status_code == 401
    forged = api.get(path, params=ti_query(failed_run), headers={"Authorization": "Bearer not.a.jwt"})
    assert forged.status_code == 403


@pytest.mark.parametrize("path", ENDPOINTS + ["/dtrain/api/ti/stack"])
def test_a_user_without_access_to_the_dag_gets_403_and_a_viewer_200(api, failed_run, path):
    params = ti_query(failed_run) | ({"rank": 1} if path.endswith("stack") else {})
    assert get(api, path, params, user=("outsider", "viewer")).status_code == 403
    expected = 404 if path.endswith("stack") else 200  # the failed job hung nowhere: no stack dump
    assert get(api, path, params, user=("viewer", "viewer")).status_code == expected


def test_the_retraining_list_holds_only_the_dags_the_user_may_read(api, airflow_db):
    admin = get(api, "/dtrain/api/retraining").json()["pipelines"]
    assert "retrain_pipeline" in [p["dag_id"] for p in admin]
    assert get(api, "/dtrain/api/retraining", user=("outsider", "viewer")).json() == {"pipelines": []}
    assert get(api, "/dtrain/api/retraining/plot.svg", {"dag_id": "retrain_pipeline"},
               user=("outsider", "viewer")).status_code == 403


@pytest.mark.parametrize("params, status", [
    ({"map_index": "../../etc/passwd"}, 422),
    ({"map_index": "1e3"}, 422),
    ({"task_id": "../../../etc"}, 404),  # no such task instance: nothing is opened
    ({"run_id": "/etc/passwd"}, 404),
])
def test_crafted_ids_are_refused(api, failed_run, params, status):
    assert get(api, "/dtrain/api/ti/summary", ti_query(failed_run) | params).status_code == status


@pytest.mark.parametrize("path, params", [
    ("/dtrain/api/ti/plot/..%2F..%2Fetc%2Fpasswd.svg", {}),
    ("/dtrain/api/ti/stack", {"rank": "../../etc/passwd"}),
    ("/dtrain/api/ti/stack", {"rank": -1}),
    ("/dtrain/static/..%2Fapp.py", {}),
    ("/dtrain/static/training.html", {}),
])
def test_crafted_paths_are_refused(api, failed_run, path, params):
    response = get(api, path, ti_query(failed_run) | params)
    assert response.status_code in (404, 422), response.text
    assert "root:" not in response.text and "def create_app" not in response.text


def test_symlinks_planted_in_the_run_directory_are_not_followed(api, hung_run, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:SECRET\n")
    run_dir = run_dir_of(api, hung_run)
    planted = [os.path.join(run_dir, "logs", "rank9.log"), os.path.join(run_dir, "hang", "rank9.txt"),
               os.path.join(run_dir, "metrics", "rank9.jsonl")]
    try:
        for path in planted:
            os.symlink(secret, path)
        os.rename(os.path.join(run_dir, "hang", "rank0.txt"), os.path.join(run_dir, "hang", "rank0.real"))
        os.symlink(secret, os.path.join(run_dir, "hang", "rank0.txt"))
        for path, params in (("/dtrain/api/ti/logs", {}), ("/dtrain/api/ti/summary", {}),
                             ("/dtrain/api/ti/curves", {}), ("/dtrain/api/ti/stack", {"rank": 9}),
                             ("/dtrain/api/ti/stack", {"rank": 0})):
            response = get(api, path, ti_query(hung_run) | params)
            assert "SECRET" not in response.text, path
        assert get(api, "/dtrain/api/ti/stack", ti_query(hung_run) | {"rank": 0}).status_code == 404
        assert "9" not in get(api, "/dtrain/api/ti/logs", ti_query(hung_run)).json()["tails"]
    finally:
        for path in planted + [os.path.join(run_dir, "hang", "rank0.txt")]:
            if os.path.islink(path):
                os.unlink(path)
        if os.path.exists(os.path.join(run_dir, "hang", "rank0.real")):
            os.rename(os.path.join(run_dir, "hang", "rank0.real"), os.path.join(run_dir, "hang", "rank0.txt"))
