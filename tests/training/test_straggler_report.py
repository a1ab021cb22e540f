"""The straggler verdicts of dtrain.stall_report from per-rank records as the training helper writes them
with a collective timer (step time, data wait, collective wait, compute time, node): in synchronous DDP
every rank's step time is the same, so only the split of a step tells the slow node from its peers. The
records here are written by hand; tests/faults/test_stragglers.py gets them from real jobs on hosts with
a throttled CPU or a rate-limited link."""

from __future__ import annotations

from dtrain.stall_report import format_report, summarize_records


def records(node: int, step_s: float, comm_s: float, steps: int = 20) -> list[dict]:
    return [{"step": i + 1, "samples": 32, "step_time_s": step_s, "data_wait_s": 0.0, "comm_wait_s": comm_s,
             "compute_time_s": step_s - comm_s, "node": node} for i in range(steps)]


def two_by_two(slow_node: int | None, comm_s: float = 0.0) -> dict[int, list[dict]]:
    """2 nodes x 2 ranks, 0.3 s steps everywhere (DDP equalises them); the slow node's ranks compute the
    whole step, their peers 0.1 s and wait the rest."""
    out = {}
    for rank in range(4):
        node = rank // 2
        wait = comm_s if slow_node is None else (0.01 if node == slow_node else 0.2)
        out[rank] = records(node, 0.3, wait)
    return out


def test_a_slow_node_is_named_with_its_ranks_and_what_its_peers_wait():
    summary = summarize_records(two_by_two(slow_node=1))
    rule = summary["rules"]["LoadBalancing"]
    assert (rule["triggered"], rule["ranks"], rule["nodes"], rule["measure"]) == (True, [2, 3], [1], "median_compute_time_s")
    assert rule["peers_wait_fraction"] == 0.6667 and not summary["rules"]["CommunicationBound"]["triggered"]
    assert summary["flags"] == ["LoadBalancing"]
    line = next(line for line in format_report(summary) if line.startswith("[stall] LoadBalancing"))
    assert line == ("[stall] LoadBalancing: TRIGGERED on ranks 2, 3 (node 1): the slowest at 1.49x the median compute "
                    "time (threshold 1.2x); the other ranks wait for them 67% of each step")
    assert "[stall] rank 2 (node 1): 15 steps, step time mean 300.00 ms median 300.00 ms, data wait 0.0%, compute " \
           "median 290.00 ms, collective wait 3.3%, 106.7 samples/s" in format_report(summary)
    assert summarize_records(two_by_two(slow_node=0))["rules"]["LoadBalancing"]["nodes"] == [0]


def test_equal_compute_names_nobody_and_a_slow_network_is_communication_bound_without_a_node():
    healthy = summarize_records(two_by_two(slow_node=None, comm_s=0.05))
    assert healthy["flags"] == [] and healthy["rules"]["LoadBalancing"]["ranks"] == []
    slow_link = summarize_records(two_by_two(slow_node=None, comm_s=0.2))
    assert slow_link["flags"] == ["CommunicationBound"] and slow_link["rules"]["LoadBalancing"]["nodes"] == []
    assert slow_link["rules"]["CommunicationBound"]["message"].startswith(
        "TRIGGERED: every rank waits at least 67% of its step in collectives (threshold 50%) and none computes slower")


def test_step_times_alone_say_ok_and_say_why():
    """A script without the timer (no comm_wait_s): DDP's equal step times cannot show a straggler, and the
    verdict says so instead of a bare ok."""
    plain = {rank: [{k: v for k, v in r.items() if k not in ("comm_wait_s", "compute_time_s")} for r in rs]
             for rank, rs in two_by_two(slow_node=1).items()}
    summary = summarize_records(plain)
    assert summary["flags"] == [] and summary["rules"]["LoadBalancing"]["measure"] == "median_step_time_s"
    assert "step times only: in synchronous DDP they are equal" in summary["rules"]["LoadBalancing"]["message"]
    assert summary["rules"]["CommunicationBound"]["message"] == "ok (no collective timing)"


def test_a_rank_cannot_pass_itself_off_as_another_node():
    """``node`` is a rank's own claim: only a small non-negative integer is believed."""
    forged = two_by_two(slow_node=1)
    for rank, value in ((2, True), (3, -1)):
        for record in forged[rank]:
            record["node"] = value
    rule = summarize_records(forged)["rules"]["LoadBalancing"]
    assert rule["ranks"] == [2, 3] and rule["nodes"] == []


def test_noise_on_tiny_steps_is_no_straggler():
    """A healthy local run measured here: 1 ms of compute beside 3 ms of all-reduce, one rank at 1.3x the
    median compute: that is 0.3 ms, under a tenth of the step, so nobody is blamed; 1 ms more is."""
    ranks = {0: records(0, 0.004, 0.003), 1: records(0, 0.004, 0.0027)}  # compute 1.0 ms and 1.3 ms
    assert summarize_records(ranks)["rules"]["LoadBalancing"]["triggered"] is False
    ranks[1] = records(0, 0.004, 0.0005)  # compute 3.5 ms: 1.25 ms over the median, and it hardly waits
    assert summarize_records(ranks)["rules"]["LoadBalancing"]["ranks"] == [1]


def test_a_rank_that_computes_longer_but_waits_like_its_peers_is_no_straggler():
    """Measured on the test cluster (hosts sharing two cores): a healthy rank computed 1.6x its peer's time
    for a whole run, and waited in the all-reduce 40% of a step against its peer's 62%. A straggler's
    peers wait for it; it hardly waits (the throttled host's rank: 12% against 90%)."""
    ranks = {0: records(0, 0.034, 0.014), 1: records(1, 0.034, 0.021)}  # compute 20 ms vs 13 ms
    rule = summarize_records(ranks)["rules"]["LoadBalancing"]
    assert rule["slowest_to_median"] > 1.2 and rule["triggered"] is False
    ranks[0] = records(0, 0.25, 0.03)  # compute 220 ms, waits 12%: the others wait for it
    ranks[1] = records(1, 0.25, 0.225)
    assert summarize_records(ranks)["rules"]["LoadBalancing"]["ranks"] == [0]
