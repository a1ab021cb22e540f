"""retrain_pipeline end to end with real Airflow, moto's S3, a temp dir as the shared filesystem and
the local backend: `airflow dags test`, REST triggers on `airflow standalone`, and a real backfill."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

from .conftest import BIN

FAST = {"nodes": 1, "procs_per_node": 2, "epochs": 6}


def fingerprint(path: str) -> tuple[str, int]:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest(), os.stat(path).st_mtime_ns


def models(env: dict[str, str]) -> str:
    return os.path.join(env["DTRAIN_SHARED_FS"], "models", "retrain_pipeline", "v1")


def test_a_dags_test_runs_the_whole_pipeline(airflow_db, pipeline_env, capsys):
    # The embedded defaults, with the integers as a JSON client may send them (2.0 is a JSON-schema
    # integer): they must reach every task as 2 and 20 (train_digits parses --epochs with int()).
    conf = json.dumps({"nodes": 2.0, "procs_per_node": 2.0, "epochs": 20.0})
    started = time.monotonic()
    proc = subprocess.run([os.path.join(BIN, "airflow"), "dags", "test", "retrain_pipeline", "2026-01-01",
                           "--conf", conf], env=pipeline_env, capture_output=True, text=True, timeout=900)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    published = os.path.join(models(pipeline_env), "2026-01-01")
    metrics = json.load(open(os.path.join(published, "metrics.json")))
    assert metrics["world_size"] == 4  # the embedded default: 2 nodes x 2 processes
    assert metrics["training"]["epochs"] == 20
    assert 'check_params: {"nodes": 2, "procs_per_node": 2, "distribution": "pytorch", "backend": "local", ' \
           '"dataset_version": "v1", "epochs": 20,' in proc.stdout
    assert metrics["evaluation"]["accuracy"] >= 0.95
    assert metrics["gate"]["publish"] and metrics["gate"]["summary"].startswith("gate: publish: accuracy 0.9")
    assert os.path.isfile(os.path.join(published, "model.pt"))
    staged = os.path.join(pipeline_env["DTRAIN_SHARED_FS"], "datasets", "retrain_pipeline", "v1", "2026-01-01")
    dataset = json.load(open(os.path.join(staged, "manifest.json")))
    assert dataset["num_samples"] == int(1797 * 0.8)
    assert os.path.isfile(os.path.join(staged, ".dtrain-manifest.json"))  # staging's own manifest
    assert "global_batch=128 lr=0.2000" in proc.stdout  # the linearly scaled rate in the train log
    assert "Credential" not in proc.stdout and "demo-secret-key" not in proc.stdout + proc.stderr
    with capsys.disabled():
        print(f"\n[e2e] airflow dags test retrain_pipeline (2x2 DDP, 20 epochs): {elapsed:.1f} s")


def test_b_rest_trigger_with_params_and_asset_scheduled_evaluation(standalone, capsys):
    # The runs the scheduler starts by itself once Airflow is up (today's, skipped: no raw data)
    # end first: a REST write while a task runs can stall the API server for 60 s
    # (AirflowServices.wait_idle). It costs nothing here: with max_active_runs=1 the REST-triggered
    # run would wait for retrain_pipeline's own scheduled run anyway.
    standalone.wait_idle()
    status, runs_before = standalone.request("GET", "/dags/retrain_pipeline/dagRuns")
    assert status == 200
    # NaN goes out as the bare literal NaN (json.dumps), which the API server's JSON parser accepts;
    # the FINITE schema keyword refuses it, and the end anchor a trailing newline (tests/pipeline/test_params.py).
    for bad in ({"nodes": 0}, {"distribution": "horovod"}, {"dataset_version": "../../etc"}, {"epochs": "many"},
                {"base_lr": float("nan")}, {"epochs": float("nan")}, {"base_lr": float("-inf")},
                {"dataset_version": "v1\n"}):
        status, body = standalone.request("POST", "/dags/retrain_pipeline/dagRuns",
                                          {"logical_date": "2026-02-01T00:00:00Z", "conf": bad})
        assert 400 <= status < 500, (bad, status, body)
        assert "Invalid input for param" in json.dumps(body), body
    status, runs_after = standalone.request("GET", "/dags/retrain_pipeline/dagRuns")
    assert runs_after["total_entries"] == runs_before["total_entries"]  # no run created

    started = time.monotonic()
    body = {"dag_run_id": "rest_trigger_2026-02-01", "logical_date": "2026-02-01T00:00:00Z", "conf": FAST}
    status, run = standalone.request("POST", "/dags/retrain_pipeline/dagRuns", body)
    if status == 409:  # a timed-out first attempt had created it
        status, run = standalone.request("GET", "/dags/retrain_pipeline/dagRuns/rest_trigger_2026-02-01")
    assert status == 200, run
    done = standalone.wait_run("retrain_pipeline", run["dag_run_id"])
    elapsed = time.monotonic() - started
    assert done["state"] == "success", standalone.failure_report("retrain_pipeline", run["dag_run_id"])
    assert done["dag_run_id"] == run["dag_run_id"] and done["logical_date"].startswith("2026-02-01"), done
    metrics = json.load(open(os.path.join(models(standalone.env), "2026-02-01", "metrics.json")))
    assert metrics["world_size"] == 2 and metrics["training"]["epochs"] == 6
    earlier = os.path.join(models(standalone.env), "2026-01-01", "model.pt")  # published by test_a, if it ran
    assert metrics["training"]["warm_start_from"] == (earlier if os.path.exists(earlier) else None)

    # The published model is an Asset: the evaluation DAG is scheduled on it.
    deadline = time.monotonic() + 300
    evaluation = os.path.join(models(standalone.env), "2026-02-01", "evaluation.json")
    while time.monotonic() < deadline and not os.path.exists(evaluation):
        time.sleep(0.5)  # a stat: cheap to ask often
    status, eval_runs = standalone.request("GET", "/dags/evaluate_published_model/dagRuns")
    assert eval_runs["total_entries"] >= 1 and eval_runs["dag_runs"][0]["run_type"] == "asset_triggered"
    assert json.load(open(evaluation))["accuracy"] >= 0.9
    with capsys.disabled():
        print(f"\n[e2e] REST-triggered run (1x2, 6 epochs) on airflow standalone: {elapsed:.1f} s")


def backfill_create(standalone, *args: str, dag_id: str = "retrain_pipeline"):
    """`airflow backfill create`, sent again when SQLite refused it: the scheduler holds the one
    writer lock and SQLite fails a read-to-write upgrade at once rather than waiting (a SQLite
    limit, not the pipeline's). A refused try can leave its backfill behind: then the next try fails with
    AlreadyRunningBackfill. If that backfill's runs are queued or running it is this one; if it has none
    (Airflow 3.3 deleted the runs the refused try had committed, not the backfill: seen in a clean-clone
    run), it is cancelled, as a user would, and created again."""
    locked = False
    for _ in range(5):
        out = standalone.airflow("backfill", "create", "--dag-id", dag_id, *args)
        if locked and "AlreadyRunningBackfill" in out.stderr:
            if backfill_runs_active(standalone, dag_id):  # the refused try created its backfill and its runs
                return subprocess.CompletedProcess(out.args, 0, out.stdout, out.stderr)
            cancel_running_backfills(standalone, dag_id)  # it left an empty one: nothing would ever run
            continue
        if out.returncode == 0 or "database is locked" not in out.stderr:
            return out
        locked = True
        time.sleep(2)
    return out


def backfill_runs_active(standalone, dag_id: str) -> bool:
    status, body = standalone.request("GET", f"/dags/{dag_id}/dagRuns?run_type=backfill&state=queued&state=running&limit=1")
    assert status == 200, body
    return body["total_entries"] > 0


def cancel_running_backfills(standalone, dag_id: str) -> None:
    status, body = standalone.request("GET", f"/backfills?dag_id={dag_id}")
    assert status == 200, body
    for backfill in body["backfills"]:
        if backfill["completed_at"] is None:
            status, cancelled = standalone.request("PUT", f"/backfills/{backfill['id']}/cancel")
            assert status == 200, cancelled


def test_c_backfill_two_dates_then_rerun_one(standalone, capsys):
    conf = json.dumps(FAST)
    started = time.monotonic()
    out = backfill_create(standalone, "--from-date", "2026-01-02", "--to-date", "2026-01-03", "--dag-run-conf", conf,
                          "--max-active-runs", "1")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    dates = ["2026-01-02", "2026-01-03"]
    for date in dates:
        run = standalone.wait_run("retrain_pipeline", f"backfill__{date}T00:00:00+00:00", timeout=900)
        assert run["state"] == "success", standalone.failure_report("retrain_pipeline", run["dag_run_id"])
    elapsed = time.monotonic() - started
    root = models(standalone.env)
    files = {d: {name: fingerprint(os.path.join(root, d, name)) for name in ("model.pt", "metrics.json")}
             for d in dates}
    assert len({files[d]["model.pt"][0] for d in dates}) == 2  # two separate models
    for d in dates:
        assert json.load(open(os.path.join(root, d, "metrics.json")))["world_size"] == 2
        staged = os.path.join(standalone.env["DTRAIN_SHARED_FS"], "datasets", "retrain_pipeline", "v1", d,
                              "manifest.json")
        assert os.path.isfile(staged)

    def backfills_done():  # the backfill itself completes a moment after its last run
        status, body = standalone.request("GET", "/backfills?dag_id=retrain_pipeline")
        return status == 200 and all(b["completed_at"] for b in body["backfills"])

    deadline = time.monotonic() + 120
    while not backfills_done() and time.monotonic() < deadline:
        time.sleep(1)  # the scheduler marks backfills complete only every 30 s (hard-coded in Airflow 3.3)
    rerun = backfill_create(standalone, "--from-date", "2026-01-03", "--to-date", "2026-01-03", "--dag-run-conf", conf,
                            "--reprocess-behavior", "completed")
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        now = fingerprint(os.path.join(root, "2026-01-03", "metrics.json"))
        if now[1] != files["2026-01-03"]["metrics.json"][1]:
            break
        time.sleep(1)
    run = standalone.wait_run("retrain_pipeline", "backfill__2026-01-03T00:00:00+00:00", timeout=600)
    assert run["state"] == "success"
    assert fingerprint(os.path.join(root, "2026-01-03", "metrics.json"))[1] != files["2026-01-03"]["metrics.json"][1]
    for d in ("2026-01-02",):  # the other date is untouched
        assert {n: fingerprint(os.path.join(root, d, n)) for n in ("model.pt", "metrics.json")} == files[d]
    runs = os.path.join(standalone.env["DTRAIN_SHARED_FS"], "runs", "retrain_pipeline", "v1", "2026-01-03")
    assert sorted(os.listdir(runs)) == ["run-0", "run-1"]  # the rerun trained afresh, the first run's checkpoints kept
    leftovers = [n for n in os.listdir(root) if n.startswith(".")]
    assert leftovers == []  # no half-published model directory
    with capsys.disabled():
        print(f"\n[e2e] backfill of 2 dates (1x2, 6 epochs each): {elapsed:.1f} s")


def test_d_dag_files_parse_without_heavy_imports(capsys):
    code = r'''
import glob, importlib.util, json, os, sys, time
t0 = time.perf_counter(); import airflow.sdk; t1 = time.perf_counter()
path = sys.argv[1]
before = set(sys.modules)
spec = importlib.util.spec_from_file_location("dagfile", path)
spec.loader.exec_module(importlib.util.module_from_spec(spec))
t2 = time.perf_counter()
new = {m.split(".")[0] for m in set(sys.modules) - before}
print(json.dumps({"sdk_s": t1 - t0, "parse_s": t2 - t1,
                  "heavy": sorted(new & {"torch", "deepspeed", "s3fs", "boto3", "botocore", "numpy", "paramiko",
                                         "tokenizers"})}))
'''
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    folders = [os.path.join(repo, "dags"), os.path.join(repo, "examples", "tabular", "dags"),  # ours, users'
               os.path.join(repo, "examples", "text", "dags")]
    files = sorted(os.path.join(d, f) for d in folders for f in os.listdir(d) if f.endswith(".py"))
    assert {"retrain_pipeline.py", "tabular_retraining.py", "text_retraining.py"} <= {os.path.basename(f) for f in files}
    lines = []
    for path in files:
        name = os.path.basename(path)
        out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert report["heavy"] == [], (name, report)
        lines.append(f"[parse] {name}: {report['parse_s']:.3f} s over a bare `import airflow.sdk` "
                     f"({report['sdk_s']:.2f} s)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
