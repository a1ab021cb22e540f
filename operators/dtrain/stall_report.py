"""Data-stall report from the per-rank metrics (``rank{R}.jsonl``), after SageMaker Debugger's rules.

    summary = summarize(metrics_dir)        # primitives only: goes to XCom as is
    for line in format_report(summary):
        log(line)

Per rank: steps, mean and median step time, the fraction of step time spent waiting for
data, samples/s. Rules:

* CPUBottleneck: a rank waits for data more than 20% of its step time (the input
  pipeline, not the model, sets the pace: preprocess before training, or add loader workers).
* LoadBalancing (a straggler). With DDP's per-step all-reduce every rank waits for the slowest, so every
  rank's step time is the same and cannot name a straggler; a rank's own compute time cannot either when
  its host is throttled (a cgroup CPU quota stops it at arbitrary points, inside its all-reduce too, so its
  compute time understates how late it comes). What survives is who waits for whom: when the ranks log
  their collective wait ``comm_wait_s`` (:mod:`dtrain.training.collectives`), each step's all-reduce ends
  for every rank once the last one arrived, so a rank came as much later than the first as it waited
  less. That compares waits only, never one host's clock with another's (real hosts' clocks differ). Per
  rank, over the steps every rank logged: how long the others waited for it (summed, as a share of
  those steps' time), and in how many steps its node came late. The verdict names the ranks (and their
  nodes: the ``node`` the training helper records) that the others wait for at least a sixth of a step
  (what a rank 1.2x slower costs its peers), at least three times as long as for the median rank, and whose
  node comes late in steps that make up at least two thirds of the time (a busy machine delays every rank
  now and then; a slow host, step after step). When one is waited for above the threshold but not named,
  the verdict says which condition failed: never ``ok`` beside a figure above its threshold. Without
  collective timing, step times are compared (1.2x the median, and at least a tenth of a step over it).
* CommunicationBound: nobody is waited for, yet every rank waits more than half of its step in
  collectives: the network sets the pace (a slow or congested link shared by all). No node is named:
  a healthy node is never blamed.
* SlowLink, when the ranks ran the link probe (:func:`dtrain.training.collectives.probe_links`, which
  times what each node receives from the previous one): names the link into a node whose transfers come
  at most a third as fast as the other nodes' median and take at least 50 ms longer (on fast links
  scheduling noise alone passes the ratio). Collective waits cannot name a link (two nodes' all-reduce
  crosses their one link both ways); transfer times can. A node named by LoadBalancing is not judged:
  a starved host receives slowly whatever its link.

The first ``skip_first`` steps of each rank (DataLoader worker start-up, warm caches) are
left out, as Debugger's rules skip their first steps.

Here, beside :mod:`dtrain.rundir`, and not in the training package: the launcher reports it after
every job (dtrain.launch.engine.launcher) and the Training tab reads it (dtrain.ui.training),
while the training helper only writes the records it reads. The launch package must not import
the training package (tests/launch/test_layers.py). Stdlib and dtrain.rundir only.
"""

from __future__ import annotations

import os
from typing import Any

from dtrain.rundir import MAX_METRICS_BYTES, RunDir, UnsafeRunDir


def median(values) -> float:
    """statistics.median, imported when a report has figures: every launch imports this module."""
    from statistics import median as of

    return of(values)


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
#: with collective arrivals, a rank is named only when its peers wait for it at least this many times as long
#: as they wait for the median rank: on a busy machine every rank is late now and then. Healthy ranks of
#: two-node jobs on hosts sharing two busy cores were waited for up to 2.2x as long as their peer over a
#: whole run; throttled hosts' ranks (cgroup quotas of 10-60 % of a CPU), 6x or more
STRAGGLER_LATE_FACTOR = 3.0
#: ... and when its node comes late (one of its ranks at least half as late as the latest) in steps that make
#: up at least this share of the time: a slow host comes late step after step, a healthy one now and then.
#: Not higher, though a healthy node of a two-node job (late in half the steps) came late in 75 % of a busy
#: run: a host slowed mid-run must be named from a window of 50 steps that still holds healthy ones
STRAGGLER_LATE_STEPS = 2 / 3
#: SlowLink: a link is slow when its node receives at most this share of the other nodes' median rate ...
SLOW_LINK_RATIO = 1 / 3
#: ... and a transfer takes at least this many seconds longer than theirs (the median)
SLOW_LINK_MIN_EXCESS_S = 0.05
#: a probe's transfer beyond this many bytes is no measurement
MAX_LINK_BYTES = 1 << 34
#: a duration beyond this (seconds) is no measurement (a rank's 1e308)
MAX_SECONDS = 1e6
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
        "median_step_time_s": round(median(step_times), 6),
        "median_compute_time_s": round(median(compute), 6) if len(compute) == len(used) else None,
        "data_wait_fraction": round(sum(waits) / total, 4) if total > 0 else 0.0,
        "comm_wait_fraction": _fraction(used, "comm_wait_s", total),
        "samples_per_s": round(samples / total, 2) if total > 0 else None,
        "node": _node(used),
    }


def late_share_threshold(load_balancing_ratio: float) -> float:
    """The share of a step a rank's peers must wait for it before it is named: what a rank computing
    ``load_balancing_ratio`` times as long as its peers costs them (at 1.2x, a sixth of its step)."""
    return 1.0 - 1.0 / load_balancing_ratio


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < MAX_SECONDS


def _waits_by_step(records: list[dict[str, Any]], skip_first: int) -> dict[int, tuple[float, float]]:
    """step -> (collective wait, step time) of one rank's records after its warm-up (a step logged twice,
    as after a resume: the last record)."""
    used = records[skip_first:] if len(records) > skip_first else records
    return {r["step"]: (float(r["comm_wait_s"]), float(r["step_time_s"])) for r in used
            if type(r.get("step")) is int and _finite(r.get("comm_wait_s")) and _finite(r.get("step_time_s"))}


def _arrivals(per_rank: dict[int, list[dict[str, Any]]], ranks: list[dict[str, Any]], skip_first: int) -> bool:
    """Who waits for whom at each step's gradient all-reduce, from the ranks' collective waits alone (no
    clock is compared across hosts, whose clocks differ): the all-reduce ends for every rank once the
    last one arrived, so a rank arrived as much later than the first as it waited less. Over the steps
    every rank logged, adds to each rank of ``ranks`` ``late_share``, how long the others waited for it
    (the sum, as a share of those steps' time), and ``late_steps``, the share of those steps in which its
    node came late (one of its ranks at least half as late as the latest: a throttled host's ranks take
    turns being the latest), each step weighing its time (a slowdown's long steps count at once: the
    live watch names a host slowed mid-run before it has made most of the steps it judges). False when
    no step was logged by every rank."""
    waits = {r["rank"]: _waits_by_step(
        [x for x in per_rank[r["rank"]] if isinstance(x.get("step_time_s"), (int, float))], skip_first) for r in ranks}
    steps = set.intersection(*(set(w) for w in waits.values()))
    if not steps:
        return False
    node = {r["rank"]: ("rank", r["rank"]) if r["node"] is None else ("node", r["node"]) for r in ranks}
    late, late_steps, total = dict.fromkeys(waits, 0.0), dict.fromkeys(node.values(), 0), 0.0
    for step in steps:
        at = {rank: w[step][0] for rank, w in waits.items()}
        first = max(at.values())  # the first to arrive waits longest
        latest = first - min(at.values())
        for rank, wait in at.items():
            late[rank] += first - wait
        step_time = median(w[step][1] for w in waits.values())
        for came_late in {node[rank] for rank, wait in at.items() if latest > 0 and first - wait >= latest / 2}:
            late_steps[came_late] += step_time
        total += step_time
    for r in ranks:
        r["late_share"] = round(late[r["rank"]] / total, 4) if total > 0 else 0.0
        r["late_steps"] = round(late_steps[node[r["rank"]]] / total, 4) if total > 0 else 0.0
    return True


def _waited_for(ranks: list[dict[str, Any]], load_balancing_ratio: float) -> tuple[list[dict[str, Any]], str | None]:
    """The ranks the others wait for (see :func:`_arrivals`), and, when none is named though one is waited
    for above the threshold, the condition that failed."""
    threshold = late_share_threshold(load_balancing_ratio)

    def failed(r: dict[str, Any]) -> str | None:
        others = median(o["late_share"] for o in ranks if o is not r)
        if r["late_share"] < threshold:
            return "below the threshold"
        if r["late_share"] < STRAGGLER_LATE_FACTOR * others:
            return (f"the others are waited for nearly as long ({others:.0%} of a step, the median; a straggler "
                    f"is waited for at least {STRAGGLER_LATE_FACTOR:g}x as long): the delays move from rank to rank")
        if r["late_steps"] < STRAGGLER_LATE_STEPS:
            return (f"its node comes late in steps that make up only {r['late_steps']:.0%} of the time "
                    f"(a straggler's: at least {STRAGGLER_LATE_STEPS:.0%})")
        return None

    slow = [r for r in ranks if failed(r) is None]
    if slow:
        return slow, None
    reason = failed(max(ranks, key=lambda r: r["late_share"]))
    return [], None if reason == "below the threshold" else reason


def _slower(ranks: list[dict[str, Any]], key: str, median_all: float, ratio: float,
            load_balancing_ratio: float) -> tuple[list[dict[str, Any]], str | None]:
    """Without collective arrivals: the ranks whose median ``key`` is above ``load_balancing_ratio`` times
    the median by at least a tenth of a step and, with compute times, that wait at most half as much as
    the others; and the condition that failed when the slowest is above the ratio but not named."""
    step = median(r["median_step_time_s"] for r in ranks) if ranks else 0.0

    def failed(r: dict[str, Any]) -> str | None:
        if r[key] <= load_balancing_ratio * median_all:
            return "below the threshold"
        if r[key] - median_all < STRAGGLER_MIN_STEP_SHARE * step:
            return (f"its excess, {(r[key] - median_all) * 1e3:.2f} ms, is under a tenth of a step "
                    f"({step * 1e3:.2f} ms): scheduling noise")
        others = [o["comm_wait_fraction"] for o in ranks if o is not r and o["comm_wait_fraction"] is not None]
        mine = r["comm_wait_fraction"]
        if key == "median_compute_time_s" and mine is not None and others and \
                mine > STRAGGLER_WAIT_SHARE * median(others):
            return (f"it waits in collectives {mine:.0%} of a step, more than half of what the others wait "
                    f"({median(others):.0%}): nobody waits for it")
        return None

    if len(ranks) < 2:
        return [], None
    slow = [r for r in ranks if failed(r) is None]
    if slow:
        return slow, None
    reason = failed(max(ranks, key=lambda r: r[key]))
    return [], None if reason == "below the threshold" else reason


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
    per_rank, links = {}, {}
    for rank, rank_records in records.items():
        steps = [r for r in rank_records if isinstance(r.get("step_time_s"), (int, float))]
        per_rank[rank] = steps[-last_steps:] if last_steps else steps
        probes = [r for r in rank_records if "link_seconds" in r]
        if probes:
            links[rank] = probes[-1]
    return summarize_records(per_rank, metrics_dir, skip_first=skip_first,
                             cpu_bottleneck_threshold=cpu_bottleneck_threshold,
                             load_balancing_ratio=load_balancing_ratio, links=links)


def summarize_records(per_rank: dict[int, list[dict[str, Any]]], metrics_dir: str = "", *, skip_first: int = 5,
                      cpu_bottleneck_threshold: float = CPU_BOTTLENECK_THRESHOLD,
                      load_balancing_ratio: float = LOAD_BALANCING_RATIO,
                      links: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """:func:`summarize` over records already read (rank -> its metrics records, in step order; ``links``:
    rank -> its link probe's record, when the ranks ran one)."""
    ranks = []
    for rank, records in per_rank.items():
        stats = _rank_stats(rank, [r for r in records if isinstance(r.get("step_time_s"), (int, float))], skip_first)
        if stats:
            ranks.append(stats)
    ranks.sort(key=lambda r: r["rank"])

    bottlenecked = [r["rank"] for r in ranks if r["data_wait_fraction"] > cpu_bottleneck_threshold]
    use_compute = bool(ranks) and all(r["median_compute_time_s"] is not None for r in ranks)
    key = "median_compute_time_s" if use_compute else "median_step_time_s"
    median_all = median(r[key] for r in ranks) if ranks else 0.0
    slowest = max(ranks, key=lambda r: r[key]) if ranks else None
    ratio = (slowest[key] / median_all) if slowest and median_all > 0 else 1.0
    arrivals = use_compute and len(ranks) > 1 and _arrivals(per_rank, ranks, skip_first)
    if arrivals:
        slow, declined = _waited_for(ranks, load_balancing_ratio)
        measure = "collective arrival"
    else:
        slow, declined = _slower(ranks, key, median_all, ratio, load_balancing_ratio)
        measure = key
    imbalanced = bool(slow)
    waits = [r["comm_wait_fraction"] for r in ranks if r not in slow]
    known_waits = all(w is not None for w in waits) and bool(waits)
    peers_wait = median(waits) if known_waits and slow else None
    comm_bound = (use_compute and not imbalanced and len(ranks) > 1
                  and all(r["comm_wait_fraction"] is not None for r in ranks)
                  and min(r["comm_wait_fraction"] for r in ranks) > COMMUNICATION_BOUND_FRACTION)
    most_late = max(slow or ranks, key=lambda r: r["late_share"]) if arrivals else None
    rules = {
        "CPUBottleneck": {
            "triggered": bool(bottlenecked), "ranks": bottlenecked, "threshold": cpu_bottleneck_threshold,
            "max_data_wait_fraction": max((r["data_wait_fraction"] for r in ranks), default=0.0),
        },
        "LoadBalancing": {
            "triggered": imbalanced, "ranks": [r["rank"] for r in slow],
            "nodes": sorted({r["node"] for r in slow if r["node"] is not None}),
            "threshold": load_balancing_ratio, "slowest_rank": slowest["rank"] if slowest else None,
            "slowest_to_median": round(ratio, 3), "measure": measure,
            "peers_wait_fraction": peers_wait, "declined": declined,
            "late_share_threshold": round(late_share_threshold(load_balancing_ratio), 4),
            "most_waited_for": None if most_late is None else {
                "rank": most_late["rank"], "late_share": most_late["late_share"],
                "late_steps": most_late["late_steps"]},
        },
        "CommunicationBound": {
            "triggered": comm_bound, "threshold": COMMUNICATION_BOUND_FRACTION,
            "min_comm_wait_fraction": min((r["comm_wait_fraction"] for r in ranks
                                           if r["comm_wait_fraction"] is not None), default=None),
        },
    }
    link_rule = _slow_links(links or {}, {r["node"] for r in slow if r["node"] is not None})
    if link_rule is not None:
        rules["SlowLink"] = link_rule
    for name, rule in rules.items():
        rule["message"] = MESSAGES[name](rule)
    total_samples_per_s = sum(r["samples_per_s"] or 0.0 for r in ranks)
    return {
        "metrics_dir": metrics_dir, "world_size_seen": len(ranks), "ranks": ranks,
        "samples_per_s": round(total_samples_per_s, 2),
        "rules": rules, "flags": [name for name, rule in rules.items() if rule["triggered"]],
    }


def _link_probe(record: dict[str, Any]) -> tuple[int, int, int, float] | None:
    """(node, from node, bytes, seconds) of one rank's probe record, or None when it is no measurement."""
    node, source, size, seconds = (record.get(k) for k in ("node", "link_from_node", "link_bytes", "link_seconds"))
    if not all(type(v) is int and 0 <= v < MAX_NODE for v in (node, source)) or node == source:
        return None
    if type(size) is not int or not 0 < size <= MAX_LINK_BYTES or not _finite(seconds) or seconds <= 0:
        return None
    return node, source, size, float(seconds)


def _slow_links(links: dict[int, dict[str, Any]], stragglers: set[int]) -> dict[str, Any] | None:
    """The SlowLink rule over the ranks' probe records (see the module docstring); None without any."""
    by_node: dict[int, list[tuple[int, int, float]]] = {}
    for record in links.values():
        probe = _link_probe(record)
        if probe is not None:
            by_node.setdefault(probe[0], []).append(probe[1:])
    if not by_node:
        return None
    measured = []
    for node, probes in sorted(by_node.items()):
        seconds = median(p[2] for p in probes)
        size = median(p[1] for p in probes)
        measured.append({"node": node, "from_node": probes[0][0], "seconds": round(seconds, 6),
                         "mb_per_s": round(size / seconds / 1e6, 3)})
    slow, declined = [], None
    for link in measured:
        others = [o for o in measured if o is not link]
        if not others:
            break
        rate = median(o["mb_per_s"] for o in others)
        excess = link["seconds"] - median(o["seconds"] for o in others)
        if link["mb_per_s"] > SLOW_LINK_RATIO * rate or excess < SLOW_LINK_MIN_EXCESS_S:
            continue
        if link["node"] in stragglers:
            declined = (f"node {link['node']} is a straggler (LoadBalancing): a starved host receives slowly "
                        "whatever its link")
            continue
        slow.append(link)
    return {"triggered": bool(slow), "nodes": [link["node"] for link in slow],
            "from_nodes": [link["from_node"] for link in slow], "links": measured,
            "threshold": round(SLOW_LINK_RATIO, 4), "min_excess_s": SLOW_LINK_MIN_EXCESS_S, "declined": declined}


def _link_message(rule: dict[str, Any]) -> str:
    links = rule["links"]
    if len(links) < 2:
        return "no verdict: one node ran the link probe"
    if rule["triggered"]:
        named = [link for link in links if link["node"] in rule["nodes"]]
        rest = [link["mb_per_s"] for link in links if link["node"] not in rule["nodes"]]
        into = ", ".join(f"the link into node {link['node']} (from node {link['from_node']}): "
                         f"{link['mb_per_s']:.1f} MB/s" for link in named)
        return (f"TRIGGERED on {into}; the other nodes receive {median(rest):.1f} MB/s (threshold: "
                f"a third as fast, and {rule['min_excess_s'] * 1e3:.0f} ms longer a transfer)")
    slowest = min(links, key=lambda link: link["mb_per_s"])
    figures = (f"slowest the link into node {slowest['node']}, {slowest['mb_per_s']:.1f} MB/s; fastest "
               f"{max(link['mb_per_s'] for link in links):.1f} MB/s")
    return f"none named: {figures}, but {rule['declined']}" if rule["declined"] else f"ok ({figures})"


def _cpu_message(rule: dict[str, Any]) -> str:
    return (f"{'TRIGGERED on ranks ' + str(rule['ranks']) if rule['triggered'] else 'ok'} "
            f"(max data wait {rule['max_data_wait_fraction']:.1%}, threshold {rule['threshold']:.0%})"
            + (": preprocess before training (dtrain preprocess) or add DataLoader workers" if rule["triggered"] else ""))


def _numbers(values: list[int]) -> str:
    return ", ".join(map(str, values))


def _who(ranks: list[int], nodes: list[int]) -> str:
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_numbers(ranks)}"
    if nodes:
        who += f" (node {_numbers(nodes)})" if len(nodes) == 1 else f" (nodes {_numbers(nodes)})"
    return who


def _arrival_message(rule: dict[str, Any]) -> str:
    most, threshold = rule["most_waited_for"], rule["late_share_threshold"]
    if rule["triggered"]:
        one = len(rule["ranks"]) == 1
        return (f"TRIGGERED on {_who(rule['ranks'], rule['nodes'])}: the other ranks wait for "
                f"{'it' if one else 'them'} "
                f"at the gradient all-reduce {most['late_share']:.0%} of each step (threshold {threshold:.0%}, what a "
                f"rank {rule['threshold']}x slower costs); {'its node comes' if one else 'their node comes'} late in "
                f"steps that make up {most['late_steps']:.0%} of the time")
    figures = (f"rank {most['rank']} is waited for most, {most['late_share']:.0%} of each step at the gradient "
               f"all-reduce (threshold {threshold:.0%})")
    if rule["declined"]:
        return f"none named: {figures}, but {rule['declined']}"
    return f"ok ({figures})"


def _load_balancing_message(rule: dict[str, Any]) -> str:
    if rule["measure"] == "collective arrival":
        return _arrival_message(rule)
    measure = "compute time" if rule["measure"] == "median_compute_time_s" else "step time"
    if rule["triggered"]:
        one = len(rule["ranks"]) == 1
        text = (f"TRIGGERED on {_who(rule['ranks'], rule['nodes'])}: the slowest at {rule['slowest_to_median']:.2f}x "
                f"the median {measure} (threshold {rule['threshold']}x)")
        if rule["peers_wait_fraction"] is not None:
            text += f"; the other ranks wait for {'it' if one else 'them'} {rule['peers_wait_fraction']:.0%} of each step"
        return text
    figures = (f"slowest rank {rule['slowest_rank']} at {rule['slowest_to_median']:.2f}x the median {measure}, "
               f"threshold {rule['threshold']}x")
    text = f"none named: {figures}, but {rule['declined']}" if rule["declined"] else f"ok ({figures})"
    if measure == "step time":
        text += ("; step times only: in synchronous DDP they are equal whatever a rank's speed "
                 "(dtrain.training.collectives times the wait)")
    return text


def _communication_message(rule: dict[str, Any]) -> str:
    least = rule["min_comm_wait_fraction"]
    if rule["triggered"]:
        return (f"TRIGGERED: every rank waits at least {least:.0%} of its step in collectives (threshold "
                f"{rule['threshold']:.0%}) and nobody is waited for: the network sets the pace (a slow or "
                f"congested link that every rank's all-reduce crosses)")
    if least is None:
        return "ok (no collective timing)"
    return f"ok (least collective wait {least:.0%} of a step, threshold {rule['threshold']:.0%})"


#: each rule's one-line verdict, for the task log and the Training tab
MESSAGES = {"CPUBottleneck": _cpu_message, "LoadBalancing": _load_balancing_message,
            "CommunicationBound": _communication_message, "SlowLink": _link_message}


def format_report(summary: dict[str, Any]) -> list[str]:
    """Log lines: one per rank, then one per rule."""
    if not summary.get("ranks"):
        return [f"[stall] no per-rank metrics in {summary.get('metrics_dir')}"]
    lines = [f"[stall] {summary['world_size_seen']} rank(s), {summary['samples_per_s']:.1f} samples/s in total"]
    for r in summary["ranks"]:
        node = "" if r.get("node") is None else f" (node {r['node']})"
        timed = ("" if r.get("median_compute_time_s") is None or r.get("comm_wait_fraction") is None else
                 f", compute median {r['median_compute_time_s'] * 1e3:.2f} ms, collective wait {r['comm_wait_fraction']:.1%}")
        waited_for = "" if r.get("late_share") is None else f", waited for {r['late_share']:.1%}"
        lines.append(f"[stall] rank {r['rank']}{node}: {r['steps']} steps, step time mean {r['mean_step_time_s'] * 1e3:.2f} ms "
                     f"median {r['median_step_time_s'] * 1e3:.2f} ms, data wait {r['data_wait_fraction']:.1%}{timed}"
                     f"{waited_for}, {r['samples_per_s'] or 0:.1f} samples/s")
    lines.extend(f"[stall] {name}: {rule['message']}" for name, rule in summary["rules"].items())
    return lines
