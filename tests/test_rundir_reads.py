"""dtrain.rundir's readers when a rank plants a directory or a FIFO where a file should be: the
file counts as missing (as a symlink does), no exception reaches the reader's caller (the
launcher, the UI, the autotuner's result reader), and no descriptor is left open."""

from __future__ import annotations

import gc
import os

import pytest

from dtrain.rundir import METRICS, RESULT, RunDir


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("plant", ["directory", "fifo"])
def test_a_planted_directory_or_fifo_reads_as_missing(tmp_path, plant):
    run = RunDir(str(tmp_path))
    run.ensure_dir(METRICS)
    target = tmp_path / METRICS / RESULT
    if plant == "directory":
        (target / "inside").mkdir(parents=True)
    else:
        os.mkfifo(target)
    before = open_fds()
    assert run.read(METRICS, RESULT, limit=100) is None
    assert run.read_json(METRICS, RESULT) is None
    assert run.read_end(METRICS, RESULT, limit=100) == (b"", True)
    assert run.read_from(METRICS, RESULT, offset=0, limit=100) is None
    assert run.tail(METRICS, RESULT, lines=5) == []
    assert run.result() == {}
    assert open_fds() == before


def test_deeply_nested_json_reads_as_no_value(tmp_path):
    # A rank-written record of a million '[' made json raise RecursionError out of the reader.
    from dtrain.rundir import RunDir

    (tmp_path / "exits").mkdir()
    (tmp_path / "exits" / "rank0.restart0.json").write_text("[" * 200_000)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rank0.jsonl").write_text('{"step": 1}\n' + "[" * 200_000 + "\n")
    run = RunDir(str(tmp_path))
    # The reads run at the edge of the recursion limit: a finalizer of an earlier test's garbage that the
    # GC ran there overflowed in pytest's unraisable hook and failed this test (a clean-clone run).
    gc.collect()
    gc.disable()
    try:
        assert run.read_json("exits", "rank0.restart0.json") is None and run.exits() == []
        assert run.metrics() == {0: [{"step": 1}]}
    finally:
        gc.enable()


def test_a_bounded_reader_reads_at_most_max_listed_names_and_counts_the_rest(tmp_path):
    """A rank can fill a folder with files: a reader that shows the directory (the UI) stops at the
    bound, counts the rest (up to as many again) and says so in ``unread``."""
    from dtrain.rundir import MAX_LISTED, METRICS_FILE, Unread

    metrics = tmp_path / METRICS
    metrics.mkdir()
    for i in range(MAX_LISTED + 10):
        (metrics / f"planted{i}").touch()
    bounded = RunDir(str(tmp_path), max_listed=MAX_LISTED)
    assert len(bounded.list(METRICS)) == MAX_LISTED
    assert bounded.unread == {METRICS: Unread(read=MAX_LISTED, more=10, counted_all=True)}
    assert bounded.ranked(METRICS, METRICS_FILE) == {}
    whole = RunDir(str(tmp_path))  # the launcher's reader: every exit record of the job it runs
    assert len(whole.list(METRICS)) == MAX_LISTED + 10 and whole.unread == {}


def test_ranked_keeps_max_ranks_and_stats_only_matching_names(tmp_path):
    from dtrain.rundir import MAX_RANKS, METRICS_FILE

    metrics = tmp_path / METRICS
    metrics.mkdir()
    for rank in range(MAX_RANKS + 3):
        (metrics / f"rank{rank}.jsonl").touch()
    (metrics / "elsewhere").symlink_to("/nonexistent")  # never stat'd: its name does not match
    run = RunDir(str(tmp_path))
    found = run.ranked(METRICS, METRICS_FILE)
    assert len(found) == MAX_RANKS
    unread = run.unread[METRICS]  # the link is one name read, wherever the folder lists it
    assert unread.read + unread.more == MAX_RANKS + 4 and unread.counted_all
