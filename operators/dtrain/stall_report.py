"""Data-stall report from the per-rank metrics (``rank{R}.jsonl``), after SageMaker Debugger's rules.

    summary = summarize(metrics_dir)        # primitives only: goes to XCom as is
    for line in format_report(summary):
        log(line)

Per rank: steps, mean and median step time, the fraction of step time spent waiting for
data, samples/s. Rules:

* CPUBottleneck: a rank waits for data more than 20% of its step time (the input
  pipeline, not the model, sets the pace: preprocess before training, or add loader workers).
* LoadBalancing: the slowest rank's median step time is above 1.2x the median across
  ranks. Note that with DDP's per-step allreduce every rank waits for the slowest, so the
  straggler's time shows up in every rank's step time; the rule then fires only when a
  script logs ``compute_time_s`` (its step without the collective wait), which is used
  instead of ``step_time_s`` when present.

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

from dtrain.rundir import RunDir, UnsafeRunDir

CPU_BOTTLENECK_THRESHOLD = 0.20
LOAD_BALANCING_RATIO = 1.2


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
        "samples_per_s": round(samples / total, 2) if total > 0 else None,
    }


def summarize(metrics_dir: str, *, skip_first: int = 5, cpu_bottleneck_threshold: float = CPU_BOTTLENECK_THRESHOLD,
              load_balancing_ratio: float = LOAD_BALANCING_RATIO) -> dict[str, Any]:
    """Per-rank figures and the two rules' verdicts; every value a JSON primitive (XCom-able)."""
    try:  # rank-written files: read through dtrain.rundir (no link followed, each file bounded)
        records = RunDir(os.path.abspath(metrics_dir)).ranked_jsonl("")
    except UnsafeRunDir:
        records = {}
    per_rank = {rank: [r for r in rank_records if isinstance(r.get("step_time_s"), (int, float))]
                for rank, rank_records in records.items()}
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
    imbalanced = len(ranks) > 1 and ratio > load_balancing_ratio
    rules = {
        "CPUBottleneck": {
            "triggered": bool(bottlenecked), "ranks": bottlenecked, "threshold": cpu_bottleneck_threshold,
            "max_data_wait_fraction": max((r["data_wait_fraction"] for r in ranks), default=0.0),
        },
        "LoadBalancing": {
            "triggered": imbalanced, "ranks": [slowest["rank"]] if imbalanced else [],
            "threshold": load_balancing_ratio, "slowest_rank": slowest["rank"] if slowest else None,
            "slowest_to_median": round(ratio, 3), "measure": key,
        },
    }
    total_samples_per_s = sum(r["samples_per_s"] or 0.0 for r in ranks)
    return {
        "metrics_dir": metrics_dir, "world_size_seen": len(ranks), "ranks": ranks,
        "samples_per_s": round(total_samples_per_s, 2),
        "rules": rules, "flags": [name for name, rule in rules.items() if rule["triggered"]],
    }


def format_report(summary: dict[str, Any]) -> list[str]:
    """Log lines: one per rank, then one per rule."""
    if not summary.get("ranks"):
        return [f"[stall] no per-rank metrics in {summary.get('metrics_dir')}"]
    lines = [f"[stall] {summary['world_size_seen']} rank(s), {summary['samples_per_s']:.1f} samples/s in total"]
    for r in summary["ranks"]:
        lines.append(f"[stall] rank {r['rank']}: {r['steps']} steps, step time mean {r['mean_step_time_s'] * 1e3:.2f} ms "
                     f"median {r['median_step_time_s'] * 1e3:.2f} ms, data wait {r['data_wait_fraction']:.1%}, "
                     f"{r['samples_per_s'] or 0:.1f} samples/s")
    cpu, lb = summary["rules"]["CPUBottleneck"], summary["rules"]["LoadBalancing"]
    lines.append(f"[stall] CPUBottleneck: {'TRIGGERED on ranks ' + str(cpu['ranks']) if cpu['triggered'] else 'ok'} "
                 f"(max data wait {cpu['max_data_wait_fraction']:.1%}, threshold {cpu['threshold']:.0%})"
                 + (": preprocess before training (dtrain preprocess) or add DataLoader workers" if cpu["triggered"] else ""))
    lines.append(f"[stall] LoadBalancing: {'TRIGGERED on rank ' + str(lb['slowest_rank']) if lb['triggered'] else 'ok'} "
                 f"(slowest rank {lb['slowest_rank']} at {lb['slowest_to_median']:.2f}x the median {lb['measure']}, "
                 f"threshold {lb['threshold']}x)")
    return lines
