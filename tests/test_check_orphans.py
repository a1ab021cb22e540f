"""scripts/check_orphans.sh (CI's last step) sees shared memory too: a name the product's jobs
create that no process maps any more is reported, one still mapped (a run in progress) is not.
Run on a directory of its own (CHECK_ORPHANS_SHM_DIR) so that other runs' /dev/shm is left alone."""

from __future__ import annotations

import mmap
import os
import subprocess

from tests.conftest import REPO


def test_the_orphan_check_reports_shared_memory_no_process_maps(tmp_path):
    for name in ("sem.mp-left", "sem.mp-held", "deepspeed_allreduce_buffer_0_127.0.0.1_29500_0",
                 "vader_segment.host.1.0", "nccl-abc", "unrelated", "sem.loky-1-x"):
        (tmp_path / name).write_bytes(b"\0" * 32)
    with open(tmp_path / "sem.mp-held", "r+b") as fh, mmap.mmap(fh.fileno(), 32):  # a run in progress
        out = subprocess.run(["bash", os.path.join(REPO, "scripts", "check_orphans.sh")], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "CHECK_ORPHANS_SHM_DIR": str(tmp_path)})
    assert out.returncode == 1, out.stdout
    reported = out.stdout.split(f"shared memory of the project is left in {tmp_path} (no process maps it):\n")[1]
    assert sorted(reported.split()) == sorted(str(tmp_path / name) for name in (
        "sem.mp-left", "deepspeed_allreduce_buffer_0_127.0.0.1_29500_0", "vader_segment.host.1.0", "nccl-abc"))


def test_the_orphan_check_reports_a_test_slurm_clusters_directory(tmp_path):
    """A Slurm test cluster removes its directory (state, spool, logs, munge key) at its stop: one left
    behind is reported."""
    import shutil
    import tempfile

    left = tempfile.mkdtemp(prefix="dtrain-slurm-")
    try:
        out = subprocess.run(["bash", os.path.join(REPO, "scripts", "check_orphans.sh")], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "CHECK_ORPHANS_SHM_DIR": str(tmp_path)})
    finally:
        shutil.rmtree(left)
    assert out.returncode == 1, out.stdout
    assert f"\n{left} (a test Slurm cluster's directory)\n" in out.stdout, out.stdout
