"""Fixtures for the preprocessing tests: raw digits partitions, the dtrain CLI and the launcher as subprocesses."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

HERE = os.path.dirname(os.path.abspath(__file__))
DIGITS = "dtrain.preprocess.examples:digits_features"
BIN = os.path.dirname(sys.executable)


def child_env(**extra: str) -> dict[str, str]:
    """The tests' own modules (tests.preprocess.prep_transforms) must import in spawned processes too."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def dtrain(*args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, "dtrain"), *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env(**env), cwd=REPO)


def launch(procs: int, run_dir: str, *command: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    extra = [f"--env={k}={v}" for k, v in env.items()]
    result = dtrain("launch", "--nodes", "1", "--procs-per-node", str(procs), "--run-dir", run_dir, *extra,
                    "--", "python", *command, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def shard_indexes(out: str) -> list[str]:
    return sorted(glob.glob(os.path.join(out, "parts", "*", "shard-*.json")))


def kill_mid_run(args: list[str], out: str, shards: int, before_kill=lambda group: None) -> list:
    """Start ``dtrain preprocess ARGS --output OUT`` in its own session and SIGKILL its whole process
    group once ``shards`` shard indexes exist, as a node crash would (the runner, its workers and
    multiprocessing's resource tracker die at once). ``before_kill`` sees the group (psutil
    processes) alive; it is returned. The group is killed whatever happens."""
    import psutil

    proc = subprocess.Popen([os.path.join(BIN, "dtrain"), *args, "--output", out], cwd=REPO,
                            env=child_env(PREP_TEST_SLEEP_S="0.01"), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(shard_indexes(out)) < shards and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the run finished before it could be killed"
        group = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        before_kill(group)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the whole group had already ended
            pass
        proc.wait(timeout=30)
    return group


def read_tree(root: str) -> dict[str, bytes]:
    """Every file under root by relative path (hidden temp files would show up too: none may remain)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = fh.read()
    return out


def write_jsonl(path: str, records: list, raw_lines: dict[int, str] | None = None) -> str:
    """Records as JSON lines; raw_lines replaces given 1-based lines with raw text (bad records)."""
    lines = [json.dumps(r) for r in records]
    for line_no, text in (raw_lines or {}).items():
        lines[line_no - 1] = text
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def digits_raw(tmp_path_factory) -> str:
    """The reference split's 1437 training digits as three JSON-lines partitions."""
    from dtrain.preprocess.examples import write_digits_jsonl

    root = str(tmp_path_factory.mktemp("digits-raw"))
    write_digits_jsonl(root, partitions=3)
    return root


@pytest.fixture(scope="session")
def digits_shards(tmp_path_factory, digits_raw) -> str:
    """A published shard dataset of the 1437 training digits (made in-process, one worker)."""
    from dtrain.preprocess.runner import preprocess

    out = str(tmp_path_factory.mktemp("digits-shards"))
    paths = sorted(os.path.join(digits_raw, n) for n in os.listdir(digits_raw))
    preprocess(paths, out, DIGITS, workers=1, shard_size=200, log=lambda _: None)
    return out
