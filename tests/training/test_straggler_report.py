"""The straggler verdicts of dtrain.stall_report from per-rank records as the training helper writes them
with a collective timer (step time, data wait, collective wait, compute time, node): in synchronous DDP
every rank's step time is the same, so only the split of a step tells the slow node from its peers. The
records here are written by hand; tests/launch/engine/faults/test_stragglers.py gets them from real jobs on hosts with
a throttled CPU or a rate-limited link."""

from __future__ import annotations

import re

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
    assert (rule["triggered"], rule["ranks"], rule["nodes"], rule["measure"]) == (True, [2, 3], [1], "collective arrival")
    assert rule["peers_wait_fraction"] == 0.6667 and not summary["rules"]["CommunicationBound"]["triggered"]
    assert summary["flags"] == ["LoadBalancing"]
    line = next(line for line in format_report(summary) if line.startswith("[stall] LoadBalancing"))
    assert line == ("[stall] LoadBalancing: TRIGGERED on ranks 2, 3 (node 1): the other ranks wait for them at the "
                    "gradient all-reduce 63% of each step (threshold 17%, what a rank 1.2x slower costs); their node comes "
                    "late in steps that make up 100% of the time")
    assert "[stall] rank 2 (node 1): 15 steps, step time mean 300.00 ms median 300.00 ms, data wait 0.0%, compute " \
           "median 290.00 ms, collective wait 3.3%, waited for 63.3%, 106.7 samples/s" in format_report(summary)
    assert summarize_records(two_by_two(slow_node=0))["rules"]["LoadBalancing"]["nodes"] == [0]


def test_equal_compute_names_nobody_and_a_slow_network_is_communication_bound_without_a_node():
    healthy = summarize_records(two_by_two(slow_node=None, comm_s=0.05))
    assert healthy["flags"] == [] and healthy["rules"]["LoadBalancing"]["ranks"] == []
    slow_link = summarize_records(two_by_two(slow_node=None, comm_s=0.2))
    assert slow_link["flags"] == ["CommunicationBound"] and slow_link["rules"]["LoadBalancing"]["nodes"] == []
    assert slow_link["rules"]["CommunicationBound"]["message"].startswith(
        "TRIGGERED: every rank waits at least 67% of its step in collectives (threshold 50%) and nobody is waited for")


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
    """A healthy local run on the test machine: 1 ms of compute beside 3 ms of all-reduce, one rank at 1.3x the
    median compute: that is 0.3 ms, under a tenth of the step, so nobody is blamed; 1 ms more is."""
    ranks = {0: records(0, 0.004, 0.003), 1: records(0, 0.004, 0.0027)}  # compute 1.0 ms and 1.3 ms
    assert summarize_records(ranks)["rules"]["LoadBalancing"]["triggered"] is False
    ranks[1] = records(0, 0.004, 0.0005)  # compute 3.5 ms: 1.25 ms over the median, and it hardly waits
    assert summarize_records(ranks)["rules"]["LoadBalancing"]["ranks"] == [1]


def test_a_rank_late_by_turns_is_no_straggler_and_the_verdict_says_why():
    """On hosts sharing two busy cores every rank is descheduled now and then: a healthy rank was waited for
    a fifth of a step over a whole run, but its peer as often. A straggler is late step after step."""
    ranks = {0: records(0, 0.034, 0.010, steps=35), 1: records(1, 0.034, 0.024, steps=35)}
    for step in range(0, 35, 3):  # every third step it is rank 1 that comes late
        ranks[0][step]["comm_wait_s"], ranks[1][step]["comm_wait_s"] = 0.026, 0.010
    rule = summarize_records(ranks)["rules"]["LoadBalancing"]
    assert rule["triggered"] is False and rule["most_waited_for"]["late_share"] > rule["late_share_threshold"]
    assert rule["message"].startswith("none named: rank 0 is waited for most, 27% of each step at the gradient "
                                      "all-reduce (threshold 17%), but the others are waited for nearly as long"), rule
    ranks = {0: records(0, 0.034, 0.010, steps=35), 1: records(1, 0.034, 0.024, steps=35)}  # late every step: named
    assert summarize_records(ranks)["rules"]["LoadBalancing"]["ranks"] == [0]


def test_a_healthy_node_late_in_three_quarters_of_a_busy_run_is_no_straggler():
    """A clean 2x1 job of 200 steps on hosts sharing two busy cores: node 0 came late in steps that made up 75 %
    of the time and was waited for 20.5 % of a step, 2.2x as long as node 1 (9.5 %). In a two-node job one
    node comes late in every step, so its healthy share is a half, and the busy machine moved it that far;
    throttled hosts in the same cluster came late in 98-100 % of the time and were waited for 6x as long or
    more. Not named; the verdict says why."""
    ranks = {0: records(0, 0.03, 0.02, steps=45), 1: records(1, 0.03, 0.02, steps=45)}
    for step in range(5, 45):  # after the five warm-up steps: node 0 late in 30 steps, node 1 in 10
        late, by = (0, 0.0082) if step < 35 else (1, 0.0114)
        ranks[1 - late][step]["comm_wait_s"] = 0.02 + by
    rule = summarize_records(ranks)["rules"]["LoadBalancing"]
    assert (rule["most_waited_for"]["late_share"], rule["most_waited_for"]["late_steps"]) == (0.205, 0.75), rule
    assert rule["triggered"] is False and rule["nodes"] == [], rule
    assert "the others are waited for nearly as long (10% of a step, the median" in rule["message"], rule
    for step in range(35, 45):  # node 0 late in every step, as long as before: a straggler
        ranks[0][step]["comm_wait_s"], ranks[1][step]["comm_wait_s"] = 0.02, 0.0282
    assert summarize_records(ranks)["rules"]["LoadBalancing"]["nodes"] == [0]


def throttled_two_by_two(steps: int = 28) -> dict[int, list[dict]]:
    """The shape of a 2x2 job whose node 1 has 30 % of one CPU: the quota stops its ranks at arbitrary
    points, inside their all-reduce too, so their compute times understate how late they come (1.5x the
    median), node 0's ranks wait 89 % of a step and node 1's 63 %, and each step's delays vary."""
    out = {}
    for rank in range(4):
        node, rows = rank // 2, []
        for step in range(1, steps + 1):
            jitter = 0.001 * ((step * (rank + 3)) % 5)
            wait = 0.036 - jitter if node == 0 else 0.025 + jitter
            compute = 0.0045 if node == 0 else 0.0075
            rows.append({"step": step, "samples": 32, "step_time_s": 0.04, "data_wait_s": 0.0, "node": node,
                         "comm_wait_s": wait, "compute_time_s": compute})
        out[rank] = rows
    return out


def test_a_throttled_node_is_named_from_who_waits_for_whom_not_its_compute_time():
    summary = summarize_records(throttled_two_by_two())
    rules = summary["rules"]
    assert (rules["LoadBalancing"]["ranks"], rules["LoadBalancing"]["nodes"]) == ([2, 3], [1]), rules
    assert summary["flags"] == ["LoadBalancing"]  # not the network: node 1 is waited for
    assert rules["LoadBalancing"]["message"].startswith("TRIGGERED on ranks 2, 3 (node 1): the other ranks wait")


def figures_beside_ok(line: str) -> list[tuple[float, float]]:
    """(figure, threshold) pairs of a verdict line that says ok: "N% ... (threshold T%" and "Nx ... threshold Tx"."""
    if not line.startswith("[stall] LoadBalancing: ok ("):
        return []
    pairs = re.findall(r"(\d+)% of each step[^(]*\(threshold (\d+)%", line)
    pairs += re.findall(r"at ([\d.]+)x the median [a-z ]+, threshold ([\d.]+)x", line)
    assert pairs, line
    return [(float(a), float(b)) for a, b in pairs]


def test_ok_is_never_printed_beside_a_figure_above_its_threshold():
    """A report said "ok (slowest rank 2 at 1.47x the median compute time, threshold 1.2x)". A
    verdict names the rank, or says which condition failed, or says ok with a figure under its threshold."""
    late_by_turns = {0: records(0, 0.034, 0.010, steps=35), 1: records(1, 0.034, 0.024, steps=35)}
    for step in range(0, 35, 3):
        late_by_turns[0][step]["comm_wait_s"], late_by_turns[1][step]["comm_wait_s"] = 0.026, 0.010
    plain = {rank: [{k: v for k, v in r.items() if k not in ("comm_wait_s", "compute_time_s")} for r in rs]
             for rank, rs in two_by_two(slow_node=1).items()}
    cases = [throttled_two_by_two(), late_by_turns, plain, two_by_two(None, 0.05),
             {0: records(0, 0.004, 0.003), 1: records(0, 0.004, 0.0027)}]
    for case in cases:
        for line in format_report(summarize_records(case)):
            assert all(figure < threshold for figure, threshold in figures_beside_ok(line)), line


def test_a_rank_cannot_steer_the_verdict_with_impossible_waits():
    """``comm_wait_s`` is a rank's own claim: a negative, infinite or huge wait is no measurement, and a step
    it claims that way is left out of who waits for whom."""
    forged = two_by_two(slow_node=1)
    for record in forged[0]:  # rank 0 claims to wait for ever: rank 0 would make everyone else look late
        record["comm_wait_s"] = float("inf")
    for record in forged[1][::2]:
        record["comm_wait_s"] = -1.0
    for record in forged[1][1::2]:
        record["comm_wait_s"] = 1e308
    rule = summarize_records(forged)["rules"]["LoadBalancing"]
    assert rule["measure"] != "collective arrival" and 0 not in rule["ranks"] and 1 not in rule["ranks"], rule
