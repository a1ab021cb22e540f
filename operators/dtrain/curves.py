"""The per-rank curves of a training job, from the ranks' metrics records: pure, no Airflow.

The Training tab draws them (dtrain.ui.training) and the tracked train task logs rank 0's as MLflow
metrics (dtrain.mlflow.tracking): both import them from here, below either package. A record's
numbers come from the ranks (untrusted): only finite values of at most :data:`MAX_VALUE` are drawn.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

#: a value beyond this is no measurement (a rank's 1e308): dropped, so sums and ratios stay finite
MAX_VALUE = 1e100
#: the per-rank curves, by API name: (title, y label)
CURVES = {
    "loss": ("Loss", "loss"),
    "samples_per_s": ("Throughput", "samples/s"),
    "data_wait_fraction": ("Data wait", "fraction of step time"),
}
#: points per rank and curve sent to a page (evenly thinned beyond, the last point always kept)
MAX_POINTS = 2000


def number(value: Any) -> float | int | None:
    """``value`` if it is a plottable number (not a bool, finite, |value| <= MAX_VALUE), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return value if math.isfinite(value) and abs(value) <= MAX_VALUE else None
    except OverflowError:  # an int too large for a float
        return None


def _value(record: Mapping[str, Any], curve: str) -> float | None:
    """The record's point on ``curve``; None when it has none a browser and a plot can carry (a
    ratio of two rank-written numbers can overflow: 1e100 / 1e-100 is past what is plottable)."""
    if curve == "data_wait_fraction":
        step, wait = number(record.get("step_time_s")), number(record.get("data_wait_s"))
        return number(round(float(wait) / float(step), 6)) if step and step > 0 and wait is not None else None
    value = number(record.get(curve))
    return None if value is None else float(value)


def thin(points: list[list[float]], limit: int) -> list[list[float]]:
    """At most ``limit`` of ``points``, evenly spaced, the last one always kept."""
    if len(points) <= limit:
        return points
    stride = len(points) / (limit - 1)
    return [points[int(i * stride)] for i in range(limit - 1)] + [points[-1]]


def curves(metrics: Mapping[int, list[dict[str, Any]]], since_step: int = -1,
           max_points: int = MAX_POINTS) -> dict[str, dict[str, list[list[float]]]]:
    """``{curve: {rank: [[step, value], ...]}}`` for every rank that logged a record after ``since_step``.

    A restart that resumed from a checkpoint logs some steps again: the newest record of a step wins,
    so a curve never runs backwards."""
    out: dict[str, dict[str, list[list[float]]]] = {name: {} for name in CURVES}
    for rank, records in sorted(metrics.items()):
        by_step: dict[int, dict[str, Any]] = {}
        for record in records:
            if record["step"] > since_step:
                by_step[record["step"]] = record
        for name in CURVES:
            points = [[step, v] for step, record in sorted(by_step.items())
                      if (v := _value(record, name)) is not None]
            if points:
                out[name][str(rank)] = thin(points, max_points)
    return out
