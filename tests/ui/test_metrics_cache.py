"""The Training tab's metrics: bounded bytes and records per run across all ranks, one copy per run directory
followed from the last offset, curves computed once per change; and rank-written numbers that JSON or a
plot cannot carry dropped, through the real API app (they answered 500 before)."""

from __future__ import annotations

import json
import math
import os

import pytest

from dtrain.rundir import RunDir
from dtrain.ui import metrics_cache
from dtrain.ui.metrics_cache import follow, parse
from tests.ui.client import get, ti_query

CURVES = ("loss", "samples_per_s", "data_wait_fraction")


def step(n: int, loss: float = 1.0, **extra) -> dict:
    return {"step": n, "loss": loss, "samples": 32, "step_time_s": 0.1, "data_wait_s": 0.02, "samples_per_s": 320.0,
            "epoch": 0, **extra}


def lines(records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


def append(path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


@pytest.fixture
def small_bounds(monkeypatch):
    """Bounds small enough for files a test writes quickly: 64 KiB and 2000 records a run."""
    monkeypatch.setattr(metrics_cache, "MAX_RUN_BYTES", 64 * 1024)
    monkeypatch.setattr(metrics_cache, "MAX_RUN_RECORDS", 2000)
    monkeypatch.setattr(metrics_cache, "_RUNS", type(metrics_cache._RUNS)())


def rank_files(directory, ranks: int, steps: int):
    (directory / "metrics").mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        (directory / "metrics" / f"rank{rank}.jsonl").write_bytes(lines(step(n, float(n)) for n in range(1, steps + 1)))


def test_a_run_reads_and_keeps_at_most_its_bounds_across_all_ranks_newest_first(tmp_path, small_bounds):
    rank_files(tmp_path, 8, 4000)  # 8 x ~480 KiB, 8 x 4000 records
    live = follow(RunDir(str(tmp_path)))
    assert 0 < live.last_read <= 64 * 1024
    assert sum(len(r) for r in live.records.values()) <= 2000 and sorted(live.records) == list(range(8))
    for records in live.records.values():
        steps = [r["step"] for r in records]
        assert steps[-1] == 4000 and steps == list(range(steps[0], 4001))  # the newest, no cut line


def test_one_copy_per_run_dir_follows_the_files_from_the_last_offset(tmp_path, small_bounds):
    rank_files(tmp_path, 2, 10)
    live = follow(RunDir(str(tmp_path)))
    before, version = live.records, live.version
    added = lines([step(11, 0.5), step(12, 0.25)])
    append(tmp_path / "metrics" / "rank1.jsonl", added)
    again = follow(RunDir(str(tmp_path)))  # another request, another RunDir object: the same copy
    assert again is live and list(metrics_cache.cached()) == [str(tmp_path)]
    assert live.last_read == len(added) and live.version == version + 1
    assert [r["step"] for r in live.records[1]] == list(range(1, 13))
    assert live.records[0][0] is before[0][0] and live.records[1][0] is before[1][0]  # read once, not parsed again
    follow(RunDir(str(tmp_path)))
    assert live.last_read == 0 and live.version == version + 1  # nothing new: nothing read


def test_what_is_drawn_is_computed_once_per_change(tmp_path, small_bounds):
    rank_files(tmp_path, 2, 10)
    calls = []

    def curves(records):
        calls.append(len(records))
        return records

    live = follow(RunDir(str(tmp_path)))
    for _ in range(3):  # the summary, the three plots: one refresh
        live.once("curves", curves)
        follow(RunDir(str(tmp_path)))
    assert calls == [2]
    append(tmp_path / "metrics" / "rank0.jsonl", lines([step(11)]))
    follow(RunDir(str(tmp_path))).once("curves", curves)
    assert calls == [2, 2]


def test_a_replaced_truncated_or_half_written_file_is_read_right(tmp_path, small_bounds):
    rank_files(tmp_path, 1, 10)
    path = tmp_path / "metrics" / "rank0.jsonl"
    live = follow(RunDir(str(tmp_path)))
    append(path, b'{"step": 11, "loss": 0.')  # the rank is writing this line
    follow(RunDir(str(tmp_path)))
    assert live.records[0][-1]["step"] == 10
    append(path, b'5}\n')
    follow(RunDir(str(tmp_path)))
    assert live.records[0][-1] == {"step": 11, "loss": 0.5}
    replacement = tmp_path / "new.jsonl"
    replacement.write_bytes(lines(step(n) for n in range(1, 30)))  # larger, another file
    os.replace(replacement, path)
    follow(RunDir(str(tmp_path)))
    assert [r["step"] for r in live.records[0]] == list(range(1, 30))
    path.write_bytes(lines([step(1, 9.0)]))  # truncated: a rank restarted from scratch
    follow(RunDir(str(tmp_path)))
    assert [(r["step"], r["loss"]) for r in live.records[0]] == [(1, 9.0)]
    os.unlink(path)
    follow(RunDir(str(tmp_path)))
    assert live.records == {}


def test_lines_no_json_parser_survives_or_longer_than_a_refresh_reads_are_skipped(tmp_path, small_bounds,
                                                                                  monkeypatch):
    path = tmp_path / "metrics" / "rank0.jsonl"
    path.parent.mkdir()
    path.write_bytes(lines([step(1), b"[" * 100_000, b"1" * 5000, step(3)]))  # RecursionError, int digits
    monkeypatch.setattr(metrics_cache, "MAX_RUN_BYTES", 1 << 20)
    live = follow(RunDir(str(tmp_path)))
    assert [r["step"] for r in live.records[0]] == [1, 3]
    monkeypatch.setattr(metrics_cache, "MAX_RUN_BYTES", 4096)
    append(path, b'{"step": 5, "loss": "' + b"x" * 10_000)  # more than a refresh reads: its end only
    follow(RunDir(str(tmp_path)))
    append(path, b'"}\n' + lines([step(6)]))
    follow(RunDir(str(tmp_path)))
    assert [r["step"] for r in live.records[0]] == [1, 3, 6]
    append(path, b'{"step": 7, "loss": "' + b"x" * 3000)  # within a read, but growing past what is kept
    follow(RunDir(str(tmp_path)))
    append(path, b"x" * 3000)
    follow(RunDir(str(tmp_path)))
    append(path, b'"}\n' + lines([step(8)]))
    follow(RunDir(str(tmp_path)))
    assert [r["step"] for r in live.records[0]] == [1, 3, 6, 8]


def test_at_most_max_runs_run_directories_are_kept_least_recently_watched_dropped(tmp_path, small_bounds):
    for i in range(metrics_cache.MAX_RUNS + 1):
        rank_files(tmp_path / str(i), 1, 3)
        follow(RunDir(str(tmp_path / str(i))))
    assert list(metrics_cache.cached()) == [str(tmp_path / str(i)) for i in range(1, metrics_cache.MAX_RUNS + 1)]


@pytest.mark.parametrize("line, kept", [
    (b'{"step": 1' + b"0" * 400 + b', "loss": 1}', None),
    (b'{"step": 1e400, "loss": 1}', None),
    (b'{"step": true, "loss": 1}', None),
    (b'{"step": -1, "loss": 1}', None),
    (b'{"step": 9007199254740992, "loss": 1}', None),
    (b'{"step": 3, "loss": 1e308, "samples_per_s": -1e308, "step_time_s": NaN, "data_wait_s": Infinity}', {"step": 3}),
    (b'{"step": 3, "loss": 1' + b"0" * 200 + b', "samples": true}', {"step": 3}),
    (b'{"step": 3, "loss": 0.5, "note": "' + b"x" * 100 + b'", "epoch": 1}', {"step": 3, "loss": 0.5}),
    (b'{"step": 9007199254740991, "loss": -1e100}', {"step": 9007199254740991, "loss": -1e100}),
])
def test_a_record_keeps_its_step_and_the_numbers_a_plot_can_carry(line, kept):
    assert parse(line) == kept


# -- through the real API app ------------------------------------------------------------------------

def read_bytes(monkeypatch) -> list[int]:
    """Counts the bytes every metrics read of the run directory returns (the old reader and the new)."""
    counted = [0]
    read_end, read_from = RunDir.read_end, RunDir.read_from

    def counting_end(self, *parts, limit):
        data, whole = read_end(self, *parts, limit=limit)
        counted[0] += len(data) if parts[:1] == ("metrics",) else 0
        return data, whole

    def counting_from(self, *parts, offset, limit):
        got = read_from(self, *parts, offset=offset, limit=limit)
        counted[0] += len(got[0]) if got and parts[:1] == ("metrics",) else 0
        return got

    monkeypatch.setattr(RunDir, "read_end", counting_end)
    monkeypatch.setattr(RunDir, "read_from", counting_from)
    return counted


def refresh(api, run) -> None:
    """What the Training tab asks for every 2 s."""
    for path in ["/dtrain/api/ti/summary", "/dtrain/api/ti/logs"] + [f"/dtrain/api/ti/plot/{c}.svg" for c in CURVES]:
        response = get(api, path, ti_query(run))
        assert response.status_code == 200, (path, response.text[:300])


def test_a_watched_run_reads_its_growing_rank_files_within_the_bound_and_from_the_last_offset(
        api, failed_run, own_run_dir, monkeypatch):
    # 8 ranks x 3 MiB: more than a refresh may read (8 MiB a run, all ranks)
    (own_run_dir / "metrics").mkdir()
    record = lines([step(1, 0.5, note="x" * 60)])
    for rank in range(8):
        (own_run_dir / "metrics" / f"rank{rank}.jsonl").write_bytes(
            lines(step(n, 1.0 / n, note="x" * 60) for n in range(1, 1 + (3 << 20) // len(record))))
    counted = read_bytes(monkeypatch)
    refresh(api, failed_run)
    first = counted[0]
    assert 0 < first <= 8 * 1024 * 1024, first
    added = lines([step(10**6, 0.001)])
    append(own_run_dir / "metrics" / "rank3.jsonl", added)
    refresh(api, failed_run)
    assert counted[0] - first == len(added)  # the appended line, read once for the whole refresh
    live = metrics_cache.cached()[str(own_run_dir)]
    assert sum(len(r) for r in live.records.values()) <= metrics_cache.MAX_RUN_RECORDS
    assert live.records[3][-1]["step"] == 10**6
    curves = get(api, "/dtrain/api/ti/curves", ti_query(failed_run)).json()["curves"]
    assert curves["loss"]["3"][-1] == [10**6, 0.001] and sorted(curves["loss"], key=int) == [str(r) for r in range(8)]


#: what a rank writes after two good steps, the curve it spoils, and the steps that curve keeps
HOSTILE = {
    "a step of 10**400": ([b'{"step": 1' + b"0" * 400 + b', "loss": 0.5, "step_time_s": 0.1, "data_wait_s": 0.02}'],
                          "loss", [1, 2]),
    "a loss of +-1e308": ([step(3, 1e308), step(4, -1e308)], "loss", [1, 2]),
    "an inf data-wait ratio": ([step(3, step_time_s=1e-300, data_wait_s=1e100),
                                step(4, step_time_s=1e-308, data_wait_s=1e308)], "data_wait_fraction", [1, 2]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_rank_written_numbers_give_a_200_with_the_value_dropped(api, failed_run, own_run_dir, case):
    (own_run_dir / "metrics").mkdir()
    written, spoilt, kept = HOSTILE[case]
    (own_run_dir / "metrics" / "rank0.jsonl").write_bytes(lines([step(1, 0.5), step(2, 0.4)] + written))
    (own_run_dir / "metrics" / "rank1.jsonl").write_bytes(lines([step(1, 0.5), step(2, 0.4), step(3, 0.3)]))
    for curve in CURVES:
        response = get(api, f"/dtrain/api/ti/plot/{curve}.svg", ti_query(failed_run))
        assert response.status_code == 200 and f'id="{curve}-rank0"' in response.text, (curve, response.text[:300])
    response = get(api, "/dtrain/api/ti/curves", ti_query(failed_run))
    assert response.status_code == 200, response.text[:300]
    curves = response.json()["curves"]
    for curve in CURVES:
        assert all(math.isfinite(v) and abs(v) <= 1e100 for _, v in curves[curve]["0"]), (curve, curves[curve]["0"])
        assert [p[0] for p in curves[curve]["1"]] == [1, 2, 3]
    assert [p[0] for p in curves[spoilt]["0"]] == kept  # the hostile values are no points
    summary = get(api, "/dtrain/api/ti/summary", ti_query(failed_run))
    assert summary.status_code == 200 and summary.json()["ranks_reporting"] == [0, 1], summary.text[:300]


def test_a_metric_name_is_shown_as_text_not_parsed_as_mathtext(api, pipeline_run):
    decision = {"metric": "$\\foo$", "goal": "minimize", "publish": False, "value": 0.5, "baseline": 0.4,
                "reasons": ["worse"]}
    pipeline_run("test_mathtext", "2099-01-01T00:00:00+00:00", {("gate", "decision"): decision})
    response = get(api, "/dtrain/api/retraining/plot.svg", {"dag_id": "retrain_pipeline"})
    assert response.status_code == 200 and response.text.startswith("<svg"), response.text[:300]
    assert "$\\foo$" in response.text  # the title, as text
