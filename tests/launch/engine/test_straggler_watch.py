"""The launcher's live straggler watch (dtrain.launch.engine.stragglers): a verdict is logged when it
appears, changes or clears, once, from each rank's last 50 steps (what the job does now), when two looks
in a row agree on it. The records are
written by hand here; tests/launch/engine/faults/test_stragglers.py runs real jobs on throttled hosts."""

from __future__ import annotations

import json

from dtrain.launch.engine.stragglers import StragglerWatch


def write(directory, rank: int, node: int, compute_s: float, steps: int = 30, start: int = 1, mode: str = "w",
          step_s: float = 0.3) -> None:
    """``steps`` records of a rank computing ``compute_s`` of each ``step_s`` step and waiting the rest."""
    with open(directory / f"rank{rank}.jsonl", mode, encoding="utf-8") as fh:
        for step in range(start, start + steps):
            fh.write(json.dumps({"step": step, "samples": 32, "step_time_s": step_s, "data_wait_s": 0.0, "node": node,
                                 "comm_wait_s": step_s - compute_s, "compute_time_s": compute_s}) + "\n")


def phase(directory, slow_ranks: tuple[int, ...], start: int, steps: int = 30) -> None:
    """Every rank's next ``steps`` steps: 0.2 s of compute each, 0.59 s on ``slow_ranks`` (then every
    step takes 0.6 s: DDP waits for the slowest)."""
    step_s = 0.6 if slow_ranks else 0.3
    for rank in range(4):
        write(directory, rank, rank // 2, 0.59 if rank in slow_ranks else 0.2, steps, start, "a", step_s)


def test_a_verdict_is_logged_when_it_appears_changes_and_clears(tmp_path):
    lines: list[str] = []
    watch = StragglerWatch(str(tmp_path), sink=lines.append)
    phase(tmp_path, (), 1, steps=300)
    watch.look()
    assert lines == []  # healthy: nothing said
    phase(tmp_path, (2, 3), 301, steps=30)  # after 300 healthy steps: the last 50 steps are what counts
    watch.look()
    watch.look()
    watch.look()  # the same verdict a third time: said once
    assert len(lines) == 1 and lines[0].startswith("[straggler] LoadBalancing: TRIGGERED on ranks 2, 3 (node 1): ")
    phase(tmp_path, (2,), 331, steps=50)  # rank 3 recovered
    watch.look()
    watch.look()
    assert lines[1].startswith("[straggler] LoadBalancing: TRIGGERED on rank 2 (node 1): "), lines
    phase(tmp_path, (), 381, steps=50)  # and rank 2
    watch.look()
    watch.look()
    assert len(lines) == 3 and lines[2].startswith("[straggler] no straggler or stall any more: LoadBalancing ok"), lines


def test_one_rank_or_unreadable_records_say_nothing(tmp_path):
    lines: list[str] = []
    write(tmp_path, 0, 0, 0.2)
    (tmp_path / "rank1.jsonl").write_text("not json\n" * 50)
    StragglerWatch(str(tmp_path), sink=lines.append).look()
    StragglerWatch(str(tmp_path / "missing"), sink=lines.append).look()
    assert lines == []


def test_nothing_is_said_before_every_rank_has_enough_steps(tmp_path):
    """The first looks of a job hold a handful of steps: one slow step would name a healthy node."""
    lines: list[str] = []
    watch = StragglerWatch(str(tmp_path), sink=lines.append)
    phase(tmp_path, (2, 3), 1, steps=24)  # 19 steps after the 5 of warm-up
    watch.look()
    assert lines == []
    phase(tmp_path, (2, 3), 25, steps=1)
    watch.look()
    watch.look()
    assert len(lines) == 1 and "TRIGGERED on ranks 2, 3 (node 1)" in lines[0]


def test_one_look_of_a_busy_stretch_names_nobody(tmp_path):
    """A healthy host busy for one look's 50 steps (another job's burst on its cores) is not a straggler: a
    verdict is said when the next look agrees, and a stretch that has passed by then is never said."""
    lines: list[str] = []
    watch = StragglerWatch(str(tmp_path), sink=lines.append)
    phase(tmp_path, (), 1, steps=300)
    watch.look()
    phase(tmp_path, (0,), 301, steps=50)  # host 0 busy for 50 steps
    watch.look()
    assert lines == []
    phase(tmp_path, (), 351, steps=50)  # and healthy again by the next look
    watch.look()
    watch.look()
    assert lines == []
    phase(tmp_path, (1,), 401, steps=50)  # a slowdown that lasts: said at the second look
    watch.look()
    assert lines == []
    phase(tmp_path, (1,), 451, steps=50)
    watch.look()
    assert len(lines) == 1 and lines[0].startswith("[straggler] LoadBalancing: TRIGGERED on rank 1 (node 0): "), lines
