"""DCP checkpoints in object storage: s3:// on moto's S3 server, through fsspec (s3fs), with the same
rule as on the shared filesystem. A 2-rank gloo job saves asynchronously every 2 steps (keep=1) and
is killed while rank 0's upload of step 6 is done but its commit marker is not written: step 4 is the
latest and loads whole (here, at world size 1), step 2 was removed only after step 4 was committed."""

from __future__ import annotations

import pytest

from tests.support import wait_for
from tests.training.dcp_checks import assert_same_state
from tests.training.test_dcp_kill import load_at_world_one

pytestmark = pytest.mark.timeout(300)


def test_s3_checkpoints_are_complete_or_invisible(jobs, tmp_path, s3):
    location = s3.url("runs/r1/ckpt").rstrip("/")
    out = tmp_path / "out"
    out.mkdir()
    job = jobs("dcp_job.py", ["--dir", location, "--out", out, "--model", "ddp", "--every", 2, "--keep", 1,
                              "--async-save", "--steps", 8, "--hang", "commit", "--hang-step", 6], 2)
    wait_for(lambda: (out / "ready.0").exists() or any(p.poll() is not None for p in job.procs), timeout=120,
             what="the save of step 6 paused before its marker")
    assert all(p.poll() is None for p in job.procs), job.logs()
    job.kill()

    listed = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix="runs/r1/ckpt/dcp/")
    keys = {o["Key"].removeprefix("runs/r1/ckpt/dcp/") for o in listed.get("Contents", [])}
    assert {"step-00000006/.metadata", "step-00000006/__1_0.distcp", "step-00000004/dtrain-commit.json"} <= keys
    assert "step-00000006/dtrain-commit.json" not in keys
    assert not any(k.startswith("step-00000002/") for k in keys)  # keep=1, and step 4 is committed
    found, state = load_at_world_one(location)
    assert found.step == 4
    assert_same_state(out / "ref-4.pt", state)
