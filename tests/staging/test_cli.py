"""`dtrain stage` and `dtrain plan` as a user runs them: real subprocesses, real moto server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dtrain.staging import manifest as M

DTRAIN = os.path.join(os.path.dirname(sys.executable), "dtrain")


def run(argv, env=None, timeout=120):
    return subprocess.run([DTRAIN, *argv], capture_output=True, text=True, env=env, timeout=timeout)


def test_stage_honours_aws_endpoint_url_from_the_environment(s3, tmp_path):
    s3.put_many({"ds/a.bin": b"a" * 100, "ds/x/b.bin": b"b" * 200})
    dest = tmp_path / "dest"
    proc = run(["stage", s3.url("ds/"), str(dest), "--workers", "4", "--json"], env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["fetched"], out["files_total"], out["bytes_fetched"]) == (2, 2, 300)
    assert (dest / "x" / "b.bin").read_bytes() == b"b" * 200
    assert "staged s3://" in proc.stderr and "fetched 2" in proc.stderr  # summary in the log
    again = json.loads(run(["stage", s3.url("ds/"), str(dest), "--json"]).stdout)
    assert (again["fetched"], again["skipped"]) == (0, 2)


def test_stage_takes_storage_options_json_or_file(s3, tmp_path):
    s3.put("ds/a.bin", b"a")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT")}
    options = {"endpoint_url": s3.endpoint, "key": "testing", "secret": "testing"}
    proc = run(["stage", s3.url("ds/"), str(tmp_path / "d1"), "--storage-options", json.dumps(options)], env=env)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "opts.json").write_text(json.dumps(options))
    proc = run(["stage", s3.url("ds/"), str(tmp_path / "d2"), "--storage-options", f"@{tmp_path / 'opts.json'}"],
               env=env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "d2" / "a.bin").read_bytes() == b"a"


def test_stage_fails_non_zero_with_a_clear_message(s3, tmp_path):
    proc = run(["stage", "s3://no-such-bucket-dtrain/p/", str(tmp_path / "d")])
    assert proc.returncode != 0 and "does not exist" in proc.stderr
    s3.put("p/../evil", b"x")
    proc = run(["stage", s3.url("p/"), str(tmp_path / "d")])
    assert proc.returncode != 0 and "refusing source key '../evil'" in proc.stderr
    proc = run(["stage", s3.url("p/"), str(tmp_path / "d"), "--workers", "0"])
    assert proc.returncode == 2 and "workers=0" in proc.stderr
    proc = run(["stage", s3.url("p/"), str(tmp_path / "d"), "--storage-options", "{not json secret"])
    assert proc.returncode == 2 and "secret" not in proc.stderr and "--storage-options" in proc.stderr


def test_stage_reports_throughput_against_the_training_need(s3, tmp_path):
    s3.put("ds/a.bin", os.urandom(1_000_000))
    proc = run(["stage", s3.url("ds/"), str(tmp_path / "d"), "--epoch-seconds", "0.000001", "--nodes", "2",
                "--deployment-type", "SCRATCH_2", "--json", "--fail-below-need"])
    assert proc.returncode == 3, proc.stderr
    verdict = json.loads(proc.stdout)["throughput"]
    assert verdict["ok"] is False and verdict["required_mbps"] == 1_000_000.0
    assert "below" in verdict["message"] and "WARNING" in proc.stderr
    assert (tmp_path / "d" / M.MANIFEST_NAME).exists()  # the data itself was staged completely


def test_plan_reproduces_the_guides_example():
    proc = run(["plan", "--dataset-size", "100GB", "--epoch-seconds", "30", "--nodes", "4",
                "--deployment-type", "SCRATCH_2"])
    assert proc.returncode == 0, proc.stderr
    assert "needs 3.33 GB/s in total, 833 MB/s per node" in proc.stdout
    assert "SCRATCH_2 at 200 MB/s/TiB: 16.8 TiB -> 3.36 GB/s" in proc.stdout
    assert "the smallest SCRATCH_2 (1.2 TiB at 200 MB/s/TiB) gives 240 MB/s" in proc.stdout
    data = json.loads(run(["plan", "--dataset-size", "100GB", "--epoch-seconds", "30", "--json"]).stdout)
    assert {o["deployment_type"] for o in data["options"]} == {"SCRATCH_1", "SCRATCH_2", "PERSISTENT_1",
                                                               "PERSISTENT_2"}


def test_plan_rejects_bad_input_naming_the_field(tmp_path):
    proc = run(["plan", "--dataset-size", "lots", "--epoch-seconds", "30"])
    assert proc.returncode == 2 and "dataset_size='lots'" in proc.stderr
    proc = run(["plan", "--dataset-size", "1GB", "--epoch-seconds", "30", "--deployment-type", "SCRATCH_9"])
    assert proc.returncode == 2 and "deployment_type='SCRATCH_9'" in proc.stderr and "SCRATCH_2" in proc.stderr
    (tmp_path / "t.json").write_text(json.dumps({"MYFS": {"throughput_mbps_per_tib": [1000],
                                                          "capacity_tib": {"first": [1.0], "increment": 1.0}}}))
    proc = run(["plan", "--dataset-size", "100GB", "--epoch-seconds", "30", "--table", str(tmp_path / "t.json")])
    assert proc.returncode == 0 and "MYFS at 1000 MB/s/TiB: 4 TiB -> 4.00 GB/s" in proc.stdout
