"""retrain_pipeline end to end with real Airflow, moto's S3, a temp dir as the shared filesystem and
the local backend: `airflow dags test`, REST triggers on a production-shaped
deployment (tests/deployment.py: PostgreSQL, Celery workers on hosts of their own), and a real backfill."""

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


def test_b_rest_trigger_with_params_and_asset_scheduled_evaluation(deployment, capsys):
    status, runs_before = deployment.request("GET", "/dags/retrain_pipeline/dagRuns")
    assert status == 200
    # NaN goes out as the bare literal NaN (json.dumps), which the API server's JSON parser accepts;
    # the FINITE schema keyword refuses it, and the end anchor a trailing newline (tests/pipeline/test_params.py).
    for bad in ({"nodes": 0}, {"distribution": "horovod"}, {"dataset_version": "../../etc"}, {"epochs": "many"},
                {"base_lr": float("nan")}, {"epochs": float("nan")}, {"base_lr": float("-inf")},
                {"dataset_version": "v1\n"}):
        status, body = deployment.request("POST", "/dags/retrain_pipeline/dagRuns",
                                          {"logical_date": "2026-02-01T00:00:00Z", "conf": bad})
        assert 400 <= status < 500, (bad, status, body)
        assert "Invalid input for param" in json.dumps(body), body
    status, runs_after = deployment.request("GET", "/dags/retrain_pipeline/dagRuns")
    assert runs_after["total_entries"] == runs_before["total_entries"]  # no run created

    started = time.monotonic()
    body = {"dag_run_id": "rest_trigger_2026-02-01", "logical_date": "2026-02-01T00:00:00Z", "conf": FAST}
    status, run = deployment.request("POST", "/dags/retrain_pipeline/dagRuns", body)
    if status == 409:  # a timed-out first attempt had created it
        status, run = deployment.request("GET", "/dags/retrain_pipeline/dagRuns/rest_trigger_2026-02-01")
    assert status == 200, run
    done = deployment.wait_run("retrain_pipeline", run["dag_run_id"])
    elapsed = time.monotonic() - started
    assert done["state"] == "success", deployment.failure_report("retrain_pipeline", run["dag_run_id"])
    assert done["dag_run_id"] == run["dag_run_id"] and done["logical_date"].startswith("2026-02-01"), done
    ran_on = deployment.hosts_that_ran("retrain_pipeline", run["dag_run_id"])
    assert ran_on and ran_on <= {host.address for host in deployment.worker_hosts}, ran_on  # the Celery workers' hosts
    metrics = json.load(open(os.path.join(models(deployment.env), "2026-02-01", "metrics.json")))
    assert metrics["world_size"] == 2 and metrics["training"]["epochs"] == 6
    earlier = os.path.join(models(deployment.env), "2026-01-01", "model.pt")  # published by test_a, if it ran
    assert metrics["training"]["warm_start_from"] == (earlier if os.path.exists(earlier) else None)

    # The published model is an Asset: the evaluation DAG is scheduled on it.
    deadline = time.monotonic() + 300
    evaluation = os.path.join(models(deployment.env), "2026-02-01", "evaluation.json")
    while time.monotonic() < deadline and not os.path.exists(evaluation):
        time.sleep(0.5)  # a stat: cheap to ask often
    status, eval_runs = deployment.request("GET", "/dags/evaluate_published_model/dagRuns")
    assert eval_runs["total_entries"] >= 1 and eval_runs["dag_runs"][0]["run_type"] == "asset_triggered"
    assert json.load(open(evaluation))["accuracy"] >= 0.9
    with capsys.disabled():
        print(f"\n[e2e] REST-triggered run (1x2, 6 epochs) on PostgreSQL + Celery: {elapsed:.1f} s")


def backfill_create(deployment, *args: str, dag_id: str = "retrain_pipeline"):
    """`airflow backfill create` for ``dag_id``, as a user runs it (on the deployment's PostgreSQL: SQLite
    refused it at times while the scheduler held its one writer lock)."""
    return deployment.airflow("backfill", "create", "--dag-id", dag_id, *args)


def test_c_backfill_two_dates_then_rerun_one(deployment, capsys):
    conf = json.dumps(FAST)
    started = time.monotonic()
    out = backfill_create(deployment, "--from-date", "2026-01-02", "--to-date", "2026-01-03", "--dag-run-conf", conf,
                          "--max-active-runs", "1")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    dates = ["2026-01-02", "2026-01-03"]
    for date in dates:
        run = deployment.wait_run("retrain_pipeline", f"backfill__{date}T00:00:00+00:00", timeout=900)
        assert run["state"] == "success", deployment.failure_report("retrain_pipeline", run["dag_run_id"])
    elapsed = time.monotonic() - started
    root = models(deployment.env)
    files = {d: {name: fingerprint(os.path.join(root, d, name)) for name in ("model.pt", "metrics.json")}
             for d in dates}
    assert len({files[d]["model.pt"][0] for d in dates}) == 2  # two separate models
    for d in dates:
        assert json.load(open(os.path.join(root, d, "metrics.json")))["world_size"] == 2
        staged = os.path.join(deployment.env["DTRAIN_SHARED_FS"], "datasets", "retrain_pipeline", "v1", d,
                              "manifest.json")
        assert os.path.isfile(staged)

    def backfills_done():  # the backfill itself completes a moment after its last run
        status, body = deployment.request("GET", "/backfills?dag_id=retrain_pipeline")
        return status == 200 and all(b["completed_at"] for b in body["backfills"])

    deadline = time.monotonic() + 120
    while not backfills_done() and time.monotonic() < deadline:
        time.sleep(1)  # the scheduler marks backfills complete only every 30 s (hard-coded in Airflow 3.3)
    rerun = backfill_create(deployment, "--from-date", "2026-01-03", "--to-date", "2026-01-03", "--dag-run-conf", conf,
                            "--reprocess-behavior", "completed")
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        now = fingerprint(os.path.join(root, "2026-01-03", "metrics.json"))
        if now[1] != files["2026-01-03"]["metrics.json"][1]:
            break
        time.sleep(1)
    run = deployment.wait_run("retrain_pipeline", "backfill__2026-01-03T00:00:00+00:00", timeout=600)
    assert run["state"] == "success"
    assert fingerprint(os.path.join(root, "2026-01-03", "metrics.json"))[1] != files["2026-01-03"]["metrics.json"][1]
    for d in ("2026-01-02",):  # the other date is untouched
        assert {n: fingerprint(os.path.join(root, d, n)) for n in ("model.pt", "metrics.json")} == files[d]
    runs = os.path.join(deployment.env["DTRAIN_SHARED_FS"], "runs", "retrain_pipeline", "v1", "2026-01-03")
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
# Airflow loads each installed provider's asset handlers when the first asset is built; with the
# amazon extra, that handler imports boto3 for any DAG with an s3:// asset. Built here first, so
# what is measured below is what the DAG file itself imports.
airflow.sdk.Asset("s3://bucket/key"); primed = time.perf_counter()
before = set(sys.modules)
spec = importlib.util.spec_from_file_location("dagfile", path)
spec.loader.exec_module(importlib.util.module_from_spec(spec))
t2 = time.perf_counter()
new = {m.split(".")[0] for m in set(sys.modules) - before}
print(json.dumps({"sdk_s": t1 - t0, "parse_s": t2 - primed,
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
