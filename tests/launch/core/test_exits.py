"""Exit records: which rank failed first (on its own, not because a peer went away), the
records written since a moment, and the time a record carries (when the rank's command ended)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dtrain.launch.core.exits import exit_records, first_failure_of, ranks_exited_since, records_since

BROKEN = "[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:28903."


def record(rank: int, code: int, time: float, tail: list[str], stopped: int | None = None) -> dict:
    return {"rank": rank, "node_rank": rank // 2, "local_rank": rank % 2, "exit_code": code,
            "stopped_by_signal": stopped, "time": time, "tail": tail}


def test_a_rank_that_lost_its_peer_is_not_named_even_when_its_wrapper_wrote_first():
    # Rank 1 raised (exit 3); rank 0 lost the connection to it and aborted in gloo's teardown
    # (134), and rank 0's wrapper happened to write its record first.
    victim = record(0, 134, 100.000, ["step 7 loss 3.43", BROKEN, "terminate called without an active exception"])
    culprit = record(1, 3, 100.004, ["step 7: RuntimeError: rank 1 hit a bad batch"])
    assert first_failure_of([victim, culprit]) == culprit


def test_when_every_failed_rank_lost_a_peer_the_earliest_is_named():
    first = record(2, 1, 50.0, ["DistNetworkError: Connection reset by peer"])
    later = record(0, 134, 50.2, [BROKEN])
    assert first_failure_of([later, first]) == first


def test_ranks_stopped_by_a_signal_or_without_a_time_are_not_failures_of_their_own():
    stopped = record(0, 143, 1.0, ["got SIGTERM"], stopped=15)
    timeless = {**record(1, 3, 1.0, ["boom"]), "time": None}
    ok = record(2, 0, 0.5, [])
    assert first_failure_of([stopped, timeless, ok]) is None
    assert first_failure_of([]) is None


def test_a_tail_that_is_not_a_list_counts_as_no_peer_lost():
    odd = {**record(1, 3, 2.0, []), "tail": "Connection closed by peer"}  # records are rank-written
    other = record(0, 1, 1.0, [BROKEN])
    assert first_failure_of([other, odd]) == odd


def write(run_dir, name: str, data) -> None:
    folder = os.path.join(run_dir, "exits")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w", encoding="utf-8") as fh:
        fh.write(data if isinstance(data, str) else json.dumps(data))


def test_records_since_reads_only_new_or_rewritten_records_and_skips_what_is_not_one(tmp_path, monkeypatch):
    run_dir = str(tmp_path)
    write(run_dir, "rank0.restart0.json", record(0, 0, 1.0, []))
    before = exit_records(run_dir)
    write(run_dir, "rank1.restart0.json", record(1, 3, 2.0, ["boom"]))
    write(run_dir, "rank2.restart0.json", "{half a rec")
    write(run_dir, "rank3.restart0.json", "[1, 2]")
    write(run_dir, ".rank4.99.tmp", json.dumps(record(4, 9, 0.1, [])))
    monkeypatch.setattr("dtrain.launch.core.exits.MAX_RECORD_BYTES", 400)
    write(run_dir, "rank5.restart0.json", record(5, 7, 3.0, ["x" * 500]))
    now = exit_records(run_dir)
    assert sorted(now) == [f"rank{r}.restart0.json" for r in (0, 1, 2, 3, 5)]
    assert records_since(run_dir, before, now) == [record(1, 3, 2.0, ["boom"])]
    assert not ranks_exited_since(before, now, 5)  # rank0's record is the old one
    assert ranks_exited_since(before, now, 4)


def test_the_record_carries_when_the_command_ended_not_when_its_output_drained(tmp_path):
    """A rank whose command leaves a child holding its output: the wrapper waits (up to 5 s) for
    the output to drain, but the record's time is the command's end, before the child's."""
    child_done = tmp_path / "child_done"
    child = ("import sys, time; time.sleep(2); open(sys.argv[1], 'w').write(repr(time.time()))")
    command = ("import subprocess, sys; "
               f"subprocess.Popen([sys.executable, '-c', {child!r}, {str(child_done)!r}]); sys.exit(3)")
    env = {**os.environ, "DTRAIN_RUN_DIR": str(tmp_path), "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
           "NODE_RANK": "0"}
    done = subprocess.run([sys.executable, "-m", "dtrain.launch.node.rank_entry", sys.executable, "-c", command],
                          env=env, capture_output=True, timeout=60)
    assert done.returncode == 3, done.stderr
    (rec,) = records_since(str(tmp_path), {}, exit_records(str(tmp_path)))
    assert (rec["rank"], rec["exit_code"]) == (1, 3)
    assert rec["time"] < float(child_done.read_text())
