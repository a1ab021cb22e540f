"""A preprocessing run killed with its whole process tree, as test_preprocess_resume kills it (a
node crash: SIGKILL to the group, multiprocessing's resource tracker included), leaves no POSIX
semaphore (``/dev/shm/sem.*``) behind: the pool's workers talk over pipes, which have no name.
concurrent.futures' pool left five ``sem.mp-*`` per run, which only the tracker would have unlinked."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

from .conftest import BIN, REPO, child_env
from .test_preprocess_resume import SLOW, shard_indexes


def shm_files_mapped_by(procs) -> set[str]:
    """The /dev/shm files these processes have mapped (a named semaphore is one such mapping)."""
    names = set()
    for proc in procs:
        try:
            with open(f"/proc/{proc.pid}/maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        names.add(fields[5].strip().removesuffix(" (deleted)"))
        except OSError:
            pass
    return names


def test_a_killed_run_leaves_no_named_semaphore(tmp_path, digits_raw):
    raw = os.path.join(digits_raw, "part-000.jsonl")
    out = str(tmp_path / "out")
    proc = subprocess.Popen([os.path.join(BIN, "dtrain"), "preprocess", "--transform", SLOW, "--input", raw,
                             "--workers", "2", "--shard-size", "50", "--output", out], cwd=REPO,
                            env=child_env(PREP_TEST_SLEEP_S="0.01"), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(shard_indexes(out)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the run finished before it could be killed"
        group = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        mapped = shm_files_mapped_by(group)
        os.killpg(proc.pid, signal.SIGKILL)  # the runner, its workers and the resource tracker, at once
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    psutil.wait_procs(group, timeout=20)
    assert len(group) >= 3, group  # the runner and its two workers were running
    left = sorted(path for path in mapped if os.path.basename(path).startswith("sem.") and os.path.exists(path))
    for path in left:  # not left for the next run either, whatever the verdict
        os.unlink(path)
    assert left == [], f"named semaphores of the killed run were left in /dev/shm: {left}"
