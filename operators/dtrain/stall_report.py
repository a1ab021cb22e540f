"""Data-stall report from the per-rank metrics (``rank{R}.jsonl``), after SageMaker Debugger's rules.

    summary = summarize(metrics_dir)        # primitives only: goes to XCom as is
    for line in format_report(summary):
        log(line)

Per rank: steps, mean and median step time, the fraction of step time spent waiting for
data, samples/s. Rules:

* CPUBottleneck: a rank waits for data more than 20% of its step time (the input
  pipeline, not the model, sets the pace: preprocess before training, or add loader workers).
* LoadBalancing (a straggler): the slowest rank's median step time is above 1.2x the median
  across ranks. With DDP's per-step all-reduce every rank waits for the slowest, so every rank's
  step time is the same and this cannot see a straggler; when the ranks log ``compute_time_s``
  (their step without the data and collective waits: :mod:`dtrain.training.collectives`) that is
  compared instead. The verdict names every rank above the threshold whose excess is at least a
  tenth of a step (below that, on tiny steps, it is scheduling noise) and which waits in collectives
  at most half as much as the others (the others wait for a straggler; it hardly waits), and their
  nodes (the ``node`` the training helper records), and how long their peers wait for them.
* CommunicationBound: no rank computes slower than the others, yet every rank waits more than
  half of its step in collectives: the network sets the pace (a slow or congested link). Step
  timing cannot tell which node's link is slow, so no node is named: a healthy node is never blamed.

The first ``skip_first`` steps of each rank (DataLoader worker start-up, warm caches) are
left out, as Debugger's rules skip their first steps.

Here, beside :mod:`dtrain.rundir`, and not in the training package: the launcher reports it after
every job (dtrain.launch.engine.launcher) and the Training tab reads it (dtrain.ui.training),
while the training helper only writes the records it reads. The launch package must not import
the training package (tests/launch/test_layers.py). Stdlib and dtrain.rundir only.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from dtrain.rundir import MAX_METRICS_BYTES, RunDir, UnsafeRunDir

CPU_BOTTLENECK_THRESHOLD = 0.20
LOAD_BALANCING_RATIO = 1.2
COMMUNICATION_BOUND_FRACTION = 0.5
#: a rank is a straggler only when what it adds over the median is at least this share of a step: with
#: tiny steps (1 ms of compute beside 3 ms of all-reduce) scheduling noise alone passes 1.2x
STRAGGLER_MIN_STEP_SHARE = 0.1
#: with collective timing, a rank is a straggler only when it also waits in collectives at most this share
#: of what the other ranks wait (as fractions of a step): the others wait for a straggler, it hardly waits.
#: Computing longer alone is not enough: on the test cluster, whose hosts share two cores, a healthy rank
#: computed 1.6x its peer's time for whole runs (it was descheduled more) while both waited alike
STRAGGLER_WAIT_SHARE = 0.5
#: a node index beyond this is no node (a rank's garbage)
MAX_NODE = 1 << 20


def _fraction(records: list[dict[str, Any]], name: str, total: float) -> float | None:
    """The sum of ``name`` over ``records`` as a fraction of ``total``; None unless every record has it."""
    values = [r.get(name) for r in records]
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    return round(sum(values) / total, 4) if total > 0 else 0.0


def _node(records: list[dict[str, Any]]) -> int | None:
    node = records[-1].get("node")
    return node if isinstance(node, int) and not isinstance(node, bool) and 0 <= node < MAX_NODE else None


def _rank_stats(rank: int, records: list[dict[str, Any]], skip_first: int) -> dict[str, Any] | None:
    used = records[skip_first:] if len(records) > skip_first else records
    if not used:
        return None
    step_times = [float(r["step_time_s"]) for r in used]
    waits = [float(r.get("data_wait_s") or 0.0) for r in used]
    compute = [float(r["compute_time_s"]) for r in used if isinstance(r.get("compute_time_s"), (int, float))]
    total = sum(step_times)
    samples = sum(int(r.get("samples") or 0) for r in used)
    return {
        "rank": rank, "steps": len(used),
        "mean_step_time_s": round(total / len(used), 6),
        "median_step_time_s": round(statistics.median(step_times), 6),
        "median_compute_time_s": round(statistics.median(compute), 6) if len(compute) == len(used) else None,
        "data_wait_fraction": round(sum(waits) / total, 4) if total > 0 else 0.0,
        "comm_wait_fraction": _fraction(used, "comm_wait_s", total),
        "samples_per_s": round(samples / total, 2) if total > 0 else None,
        "node": _node(used),
    }


def summarize(metrics_dir: str, *, skip_first: int = 5, cpu_bottleneck_threshold: float = CPU_BOTTLENECK_THRESHOLD,
              load_balancing_ratio: float = LOAD_BALANCING_RATIO, window_bytes: int | None = None,
              last_steps: int | None = None) -> dict[str, Any]:
    """Per-rank figures and the rules' verdicts; every value a JSON primitive (XCom-able).
    ``window_bytes``, ``last_steps``: only the newest that many bytes of each rank's records, and of
    those the last that many steps (a look while the job runs: what the job does now)."""
    try:  # rank-written files: read through dtrain.rundir (no link followed, each file bounded)
        records = RunDir(os.path.abspath(metrics_dir)).ranked_jsonl("", limit=window_bytes or MAX_METRICS_BYTES)
    except UnsafeRunDir:
        records = {}
    per_rank = {}
    for rank, rank_records in records.items():
        steps = [r for r in rank_records if isinstance(r.get("step_time_s"), (int, float))]
        per_rank[rank] = steps[-last_steps:] if last_steps else steps
    return summarize_records(per_rank, metrics_dir, skip_first=skip_first,
                             cpu_bottleneck_threshold=cpu_bottleneck_threshold,
                             load_balancing_ratio=load_balancing_ratio)


def summarize_records(per_rank: dict[int, list[dict[str, Any]]], metrics_dir: str = "", *, skip_first: int = 5,
                      cpu_bottleneck_threshold: float = CPU_BOTTLENECK_THRESHOLD,
                      load_balancing_ratio: float = LOAD_BALANCING_RATIO) -> dict[str, Any]:
    """:func:`summarize` over records already read (rank -> its metrics records, in step order)."""
    ranks = []
    for rank, records in per_rank.items():
        stats = _rank_stats(rank, [r for r in records if isinstance(r.get("step_time_s"), (int, float))], skip_first)
        if stats:
            ranks.append(stats)
    ranks.sort(key=lambda r: r["rank"])

    bottlenecked = [r["rank"] for r in ranks if r["data_wait_fraction"] > cpu_bottleneck_threshold]
    use_compute = bool(ranks) and all(r["median_compute_time_s"] is not None for r in ranks)
    key = "median_compute_time_s" if use_compute else "median_step_time_s"
    median_all = statistics.median(r[key] for r in ranks) if ranks else 0.0
    slowest = max(ranks, key=lambda r: r[key]) if ranks else None
    ratio = (slowest[key] / median_all) if slowest and median_all > 0 else 1.0
    step = statistics.median(r["median_step_time_s"] for r in ranks) if ranks else 0.0

    def is_slow(r: dict[str, Any]) -> bool:
        return (r[key] > load_balancing_ratio * median_all and r[key] - median_all > STRAGGLER_MIN_STEP_SHARE * step
                and (not use_compute or waits_less(r)))

    def waits_less(r: dict[str, Any]) -> bool:
        others = [o["comm_wait_fraction"] for o in ranks if o is not r and o["comm_wait_fraction"] is not None]
        mine = r["comm_wait_fraction"]
        return mine is None or not others or mine <= STRAGGLER_WAIT_SHARE * statistics.median(others)

    imbalanced = len(ranks) > 1 and ratio > load_balancing_ratio and is_slow(slowest)
    slow = [r for r in ranks if is_slow(r)] if imbalanced else []
    waits = [r["comm_wait_fraction"] for r in ranks if r not in slow]
    known_waits = all(w is not None for w in waits) and bool(waits)
    peers_wait = statistics.median(waits) if known_waits and slow else None
    comm_bound = (use_compute and not imbalanced and len(ranks) > 1
                  and all(r["comm_wait_fraction"] is not None for r in ranks)
                  and min(r["comm_wait_fraction"] for r in ranks) > COMMUNICATION_BOUND_FRACTION)
    rules = {
        "CPUBottleneck": {
            "triggered": bool(bottlenecked), "ranks": bottlenecked, "threshold": cpu_bottleneck_threshold,
            "max_data_wait_fraction": max((r["data_wait_fraction"] for r in ranks), default=0.0),
        },
        "LoadBalancing": {
            "triggered": imbalanced, "ranks": [r["rank"] for r in slow],
            "nodes": sorted({r["node"] for r in slow if r["node"] is not None}),
            "threshold": load_balancing_ratio, "slowest_rank": slowest["rank"] if slowest else None,
            "slowest_to_median": round(ratio, 3), "measure": key,
            "peers_wait_fraction": peers_wait,
        },
        "CommunicationBound": {
            "triggered": comm_bound, "threshold": COMMUNICATION_BOUND_FRACTION,
            "min_comm_wait_fraction": min((r["comm_wait_fraction"] for r in ranks
                                           if r["comm_wait_fraction"] is not None), default=None),
        },
    }
    for name, rule in rules.items():
        rule["message"] = MESSAGES[name](rule)
    total_samples_per_s = sum(r["samples_per_s"] or 0.0 for r in ranks)
    return {
        "metrics_dir": metrics_dir, "world_size_seen": len(ranks), "ranks": ranks,
        "samples_per_s": round(total_samples_per_s, 2),
        "rules": rules, "flags": [name for name, rule in rules.items() if rule["triggered"]],
    }


def _cpu_message(rule: dict[str, Any]) -> str:
    return (f"{'TRIGGERED on ranks ' + str(rule['ranks']) if rule['triggered'] else 'ok'} "
            f"(max data wait {rule['max_data_wait_fraction']:.1%}, threshold {rule['threshold']:.0%})"
            + (": preprocess before training (dtrain preprocess) or add DataLoader workers" if rule["triggered"] else ""))


def _numbers(values: list[int]) -> str:
    return ", ".join(map(str, values))


def _load_balancing_message(rule: dict[str, Any]) -> str:
    measure = "compute time" if rule["measure"] == "median_compute_time_s" else "step time"
    if rule["triggered"]:
        ranks, nodes = rule["ranks"], rule["nodes"]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_numbers(ranks)}"
        if nodes:
            who += f" (node {_numbers(nodes)})" if len(nodes) == 1 else f" (nodes {_numbers(nodes)})"
        text = (f"TRIGGERED on {who}: the slowest at {rule['slowest_to_median']:.2f}x the median {measure} "
                f"(threshold {rule['threshold']}x)")
        if rule["peers_wait_fraction"] is not None:
            text += f"; the other ranks wait for {'it' if len(ranks) == 1 else 'them'} " \
                    f"{rule['peers_wait_fraction']:.0%} of each step"
        return text
    text = (f"ok (slowest rank {rule['slowest_rank']} at {rule['slowest_to_median']:.2f}x the median {measure}, "
            f"threshold {rule['threshold']}x)")
    if measure == "step time":
        text += ("; step times only: in synchronous DDP they are equal whatever a rank's speed "
                 "(dtrain.training.collectives times the wait)")
    return text


def _communication_message(rule: dict[str, Any]) -> str:
    least = rule["min_comm_wait_fraction"]
    if rule["triggered"]:
        return (f"TRIGGERED: every rank waits at least {least:.0%} of its step in collectives (threshold "
                f"{rule['threshold']:.0%}) and none computes slower: the network sets the pace (a slow or "
                f"congested link; step timing cannot tell whose)")
    if least is None:
        return "ok (no collective timing)"
    return f"ok (least collective wait {least:.0%} of a step, threshold {rule['threshold']:.0%})"


#: each rule's one-line verdict, for the task log and the Training tab
MESSAGES = {"CPUBottleneck": _cpu_message, "LoadBalancing": _load_balancing_message,
            "CommunicationBound": _communication_message}


def format_report(summary: dict[str, Any]) -> list[str]:
    """Log lines: one per rank, then one per rule."""
    if not summary.get("ranks"):
        return [f"[stall] no per-rank metrics in {summary.get('metrics_dir')}"]
    lines = [f"[stall] {summary['world_size_seen']} rank(s), {summary['samples_per_s']:.1f} samples/s in total"]
    for r in summary["ranks"]:
        node = "" if r.get("node") is None else f" (node {r['node']})"
        timed = ("" if r.get("median_compute_time_s") is None or r.get("comm_wait_fraction") is None else
                 f", compute median {r['median_compute_time_s'] * 1e3:.2f} ms, collective wait {r['comm_wait_fraction']:.1%}")
        lines.append(f"[stall] rank {r['rank']}{node}: {r['steps']} steps, step time mean {r['mean_step_time_s'] * 1e3:.2f} ms "
                     f"median {r['median_step_time_s'] * 1e3:.2f} ms, data wait {r['data_wait_fraction']:.1%}{timed}, "
                     f"{r['samples_per_s'] or 0:.1f} samples/s")
    lines.extend(f"[stall] {name}: {rule['message']}" for name, rule in summary["rules"].items())
    return lines
