"""bench/join.py's figure without its jobs: the time from the last rank's import to the last
rank's join, read from the ranks' records; a run that left another number of records stops it."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "bench")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)  # what running it as a script does: its `launch` and `timing` imports
    spec = importlib.util.spec_from_file_location("bench_join", os.path.join(BENCH, "join.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(folder, rank: int, imported: float, joined: float) -> None:
    (folder / f"rank{rank}.json").write_text(json.dumps({"imported": imported, "joined": joined}))


def test_the_wait_runs_from_the_last_import_to_the_last_join(bench, tmp_path):
    record(tmp_path, 0, imported=10.0, joined=10.9)  # imported first, waited for rank 1
    record(tmp_path, 1, imported=10.5, joined=10.75)
    assert bench.join_wait(str(tmp_path)) == pytest.approx(0.4)


def test_a_run_without_both_records_stops_the_bench(bench, tmp_path):
    record(tmp_path, 0, imported=1.0, joined=2.0)
    with pytest.raises(SystemExit, match="expected 2 rank records"):
        bench.join_wait(str(tmp_path))


def test_both_tools_run_the_joining_script(bench):
    assert {name: argv[-1] for name, argv in bench.tool_commands(bench.JOB).items()} == {
        "dtrain": bench.JOB, "torchrun": bench.JOB}
    assert os.path.isfile(bench.JOB)
