"""dtrain.rundir's readers when a rank plants a directory or a FIFO where a file should be: the
file counts as missing (as a symlink does), no exception reaches the reader's caller (the
launcher, the UI, the autotuner's result reader), and no descriptor is left open."""

from __future__ import annotations

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
