"""bench/gpu.py, the GPU path in one command: its orchestration, and its launch part run small on the CPU
(the parts' own quick runs are tested beside them), so that a bench nobody runs without a GPU cannot rot."""

from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


@pytest.fixture
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import gpu

    return gpu


def test_unknown_parts_are_refused_naming_the_allowed_ones(bench_path):
    with pytest.raises(SystemExit) as refused:
        bench_path.main(["--parts", "feed,gpus", "--device", "cpu"])
    assert "--parts='feed,gpus'" in str(refused.value) and "launch, feed, loop, checkpoint" in str(refused.value)


def test_a_part_that_raises_is_a_missed_goal_and_the_next_part_still_runs(bench_path, tmp_path, monkeypatch):
    (tmp_path / "gpu_broken.py").write_text("def lines(device, quick, workdir):\n    raise OSError('disk gone')\n")
    (tmp_path / "gpu_fine.py").write_text(
        "from gpu_common import Line\n"
        "def lines(device, quick, workdir):\n    yield Line('fine', 'ran in ' + workdir.rsplit('/', 1)[-1], True)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    lines = [*bench_path.part_lines("broken", "cpu", True, str(tmp_path)),
             *bench_path.part_lines("fine", "cpu", True, str(tmp_path))]
    assert [(line.name, line.ok) for line in lines] == [
        ("broken: error", False), ("broken: took", None), ("fine", True), ("fine: took", None)]
    assert lines[0].text == "OSError: disk gone" and lines[2].text == "ran in fine"
    assert bench_path.report(lines) == 1
    assert bench_path.report(lines[2:]) == 0


@pytest.mark.slow
def test_the_launch_part_trains_the_text_example_small_on_the_cpu(bench_path, tmp_path):
    import gpu_launch

    line = gpu_launch.text_example_line("cpu", True, str(tmp_path))
    assert line.name == "launch: text example 1 node x 1 proc", line.render()
    assert line.text.startswith("exit 0, ") and "vs untrained 512" in line.text
    assert line.ok is None  # quick runs judge no goal
