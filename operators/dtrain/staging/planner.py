"""Throughput planner: what read throughput training needs, and which shared filesystem gives it.

Required read throughput = dataset bytes / target seconds per epoch (the whole set is
read once per epoch), split evenly over the nodes. For each FSx for Lustre deployment
type (a table kept as data, see :mod:`dtrain.staging.fsx_table`) the storage capacity
that provides it is throughput / (MB/s per TiB), rounded up to the type's increments and
never below what the dataset occupies. After a stage, the measured staging throughput is
compared with the need.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from dtrain import grammar
from dtrain.errors import SpecError
from dtrain.staging.errors import ThroughputError
from dtrain.staging.fsx_table import FSX_LUSTRE

TIB = 1024 ** 4


@dataclass
class Option:
    deployment_type: str
    mbps_per_tib: float
    capacity_tib: float
    throughput_mbps: float
    burst_mbps: float | None = None


@dataclass
class Plan:
    dataset_bytes: int
    epoch_seconds: float
    nodes: int
    required_mbps: float          # MB/s (10^6 bytes) the whole job reads
    per_node_mbps: float
    options: list[Option] = field(default_factory=list)
    smallest: list[str] = field(default_factory=list)   # what the smallest filesystem of each type gives

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [f"dataset {self.dataset_bytes / 1e9:.1f} GB read once per {self.epoch_seconds:g} s epoch on "
               f"{self.nodes} node(s): needs {_rate(self.required_mbps)} in total, "
               f"{_rate(self.per_node_mbps)} per node"]
        for o in self.options:
            burst = f" (burst {_rate(o.burst_mbps)})" if o.burst_mbps else ""
            out.append(f"  {o.deployment_type} at {o.mbps_per_tib:g} MB/s/TiB: {o.capacity_tib:g} TiB -> "
                       f"{_rate(o.throughput_mbps)} baseline{burst}")
        out.extend(f"  {line}" for line in self.smallest)
        return out


def _rate(mbps: float) -> str:
    return f"{mbps / 1000:.2f} GB/s" if mbps >= 1000 else f"{mbps:.0f} MB/s"


def load_table(table: Mapping[str, Any] | str | None) -> dict[str, dict]:
    """The deployment-type table: the built-in one, a mapping, or a JSON file path; validated."""
    if table is None:
        return FSX_LUSTRE
    if isinstance(table, str):
        from dtrain.args import read_input_file

        text = read_input_file("table", table)
        try:
            table = json.loads(text)
        except ValueError as e:
            raise SpecError("table", table, f"a JSON file shaped like the built-in table ({e})") from e
    if not isinstance(table, Mapping) or not table:
        raise SpecError("table", table, "a non-empty mapping of deployment type -> {throughput_mbps_per_tib, capacity_tib}")
    for name, row in table.items():
        try:
            rates = [float(r) for r in row["throughput_mbps_per_tib"]]
            first = [float(c) for c in row["capacity_tib"]["first"]]
            increment = float(row["capacity_tib"]["increment"])
        except (KeyError, TypeError, ValueError) as e:
            raise SpecError(f"table[{name!r}]", row, "throughput_mbps_per_tib: [numbers], "
                            "capacity_tib: {first: [numbers], increment: number}") from e
        if not rates or min(rates) <= 0 or not first or min(first) <= 0 or increment <= 0:
            raise SpecError(f"table[{name!r}]", row, "positive throughputs, capacities and increment")
    return dict(table)


def round_capacity(needed_tib: float, capacity: Mapping[str, Any]) -> float:
    """The smallest allowed capacity (first steps, then the increment) that is >= needed_tib."""
    first = sorted(float(c) for c in capacity["first"])
    for c in first:
        if c >= needed_tib - 1e-9:
            return c
    increment = float(capacity["increment"])
    steps = math.ceil((needed_tib - first[-1]) / increment - 1e-9)
    return round(first[-1] + steps * increment, 6)


def plan(dataset_bytes: Any, epoch_seconds: Any, nodes: Any = 1, deployment_type: str | None = None,
         table: Mapping[str, Any] | str | None = None) -> Plan:
    """Size the shared filesystem for reading ``dataset_bytes`` once every ``epoch_seconds``."""
    from dtrain.args import coerce_float, node_range
    from dtrain.staging.engine import parse_size

    size = parse_size("dataset_size", dataset_bytes)
    if size <= 0:
        raise SpecError("dataset_size", dataset_bytes, "a positive size such as 100GB")
    seconds = coerce_float("epoch_seconds", epoch_seconds)
    # an elastic job's MIN: the fewest nodes it may run on, each then reading the most
    nodes, _ = node_range("nodes", nodes, maximum=grammar.MAX_NODES)
    rows = load_table(table)
    if deployment_type is not None and deployment_type not in rows:
        raise SpecError("deployment_type", deployment_type, f"one of {', '.join(sorted(rows))}")
    required = size / 1e6 / seconds
    result = Plan(dataset_bytes=size, epoch_seconds=seconds, nodes=nodes, required_mbps=round(required, 1),
                  per_node_mbps=round(required / nodes, 1))
    data_tib = size / TIB
    for name in ([deployment_type] if deployment_type else list(rows)):
        row = rows[name]
        for rate in row["throughput_mbps_per_tib"]:
            rate = float(rate)
            capacity = round_capacity(max(required / rate, data_tib), row["capacity_tib"])
            burst = row.get("burst_mbps_per_tib")
            result.options.append(Option(name, rate, capacity, round(capacity * rate, 1),
                                         round(capacity * float(burst), 1) if burst else None))
        smallest = round_capacity(0, row["capacity_tib"])
        rate = float(min(row["throughput_mbps_per_tib"]))
        epoch = size / 1e6 / (smallest * rate)
        result.smallest.append(f"the smallest {name} ({smallest:g} TiB at {rate:g} MB/s/TiB) gives "
                               f"{_rate(smallest * rate)}: one epoch would take at least {epoch:.0f} s")
    return result


def verdict(p: Plan, measured_mbps: float | None, fail: bool = False) -> dict[str, Any]:
    """Compare the measured staging throughput with what training needs.

    Returns a dict for logs/XCom; raises ThroughputError when ``fail`` and the measured
    throughput is below the need.
    """
    out: dict[str, Any] = {"required_mbps": p.required_mbps, "per_node_mbps": p.per_node_mbps,
                           "measured_mbps": measured_mbps, "options": [asdict(o) for o in p.options]}
    if not measured_mbps:
        out.update(ok=None, message="nothing was fetched, so staging throughput was not measured")
        return out
    ok = measured_mbps >= p.required_mbps
    best = min(p.options, key=lambda o: o.capacity_tib) if p.options else None
    sizing = f"; {best.deployment_type} needs {best.capacity_tib:g} TiB for it" if best else ""
    if ok:
        message = (f"staging wrote {_rate(measured_mbps)}, at least the {_rate(p.required_mbps)} training reads")
    else:
        message = (f"staging wrote {_rate(measured_mbps)}, below the {_rate(p.required_mbps)} training needs "
                   f"({_rate(p.per_node_mbps)} per node): the shared filesystem or the network may stall "
                   f"training{sizing}")
    out.update(ok=ok, message=message)
    if fail and not ok:
        raise ThroughputError(message)
    return out
