"""A preprocessing run killed with its whole process tree, as test_preprocess_resume kills it (a
node crash: SIGKILL to the group, multiprocessing's resource tracker included), leaves no POSIX
semaphore (``/dev/shm/sem.*``) behind: the pool's workers talk over pipes, which have no name.
concurrent.futures' pool left five ``sem.mp-*`` per run, which only the tracker would have unlinked."""

from __future__ import annotations

import os

import psutil

from .conftest import kill_mid_run
from .test_preprocess_resume import SLOW


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
    mapped: set[str] = set()
    args = ["preprocess", "--transform", SLOW, "--input", os.path.join(digits_raw, "part-000.jsonl"),
            "--workers", "2", "--shard-size", "50"]
    group = kill_mid_run(args, str(tmp_path / "out"), shards=2,
                         before_kill=lambda alive: mapped.update(shm_files_mapped_by(alive)))
    psutil.wait_procs(group, timeout=20)
    assert len(group) >= 3, group  # the runner and its two workers were running
    left = sorted(path for path in mapped if os.path.basename(path).startswith("sem.") and os.path.exists(path))
    for path in left:  # not left for the next run either, whatever the verdict
        os.unlink(path)
    assert left == [], f"named semaphores of the killed run were left in /dev/shm: {left}"
