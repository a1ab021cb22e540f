"""The restart tests on the local backend (tests/launch/engine/faults/test_restart.py says what they check): a module of
their own, so they run beside the ssh and Slurm ones under pytest-xdist (a module goes whole to the worker
of the daemons it uses)."""

from __future__ import annotations

import pytest

from tests.launch.engine.faults.test_restart import MODES, assert_resumed, fault_rank, local_spec, run_bounded


@pytest.mark.parametrize("mode", sorted(MODES))
def test_local_2x2_restart_resumes_from_checkpoint(tmp_path, mode):
    rank = fault_rank(mode, 4)
    # 11 steps per epoch at 2x2: 22 steps, about 1 s of training (0.05 s a step) on each side of the fault.
    result, lines, fired = run_bounded(local_spec(tmp_path, 2, rank, mode, epochs=2), limit_s=120)
    assert_resumed(result, lines, fired, fault_rank=rank, mode=mode)


def test_local_1x2_restart_resumes_four_times_in_a_row(tmp_path):
    """The local 1x2 case, in both modes (2 runs each, alternating: rank 1 SIGKILLed, rank 0
    exiting 3), four fresh jobs in one test: no hang, no flake (ten until the suite needed the time
    for the elastic tests; the restart tests of every backend run beside it)."""
    for attempt in range(4):
        mode = ("sigkill", "exit3")[attempt % 2]
        rank = fault_rank(mode, 2)
        # 22 steps per epoch at 1x2, 0.02 s each: the fault comes about 0.25 s into training.
        result, lines, fired = run_bounded(
            local_spec(tmp_path / str(attempt), 1, rank, mode, epochs=1, step_sleep=0.02), limit_s=90)
        try:
            assert_resumed(result, lines, fired, fault_rank=rank, mode=mode)
        except AssertionError as e:
            raise AssertionError(f"attempt {attempt} ({mode}): {e}") from e
