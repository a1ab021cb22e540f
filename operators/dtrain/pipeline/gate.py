"""The publish gate: one named metric, a direction, an absolute bar and/or the published model.

Pure: no Airflow, no I/O. The pipeline's ``gate`` task calls :meth:`Gate.decide` with the
metrics the user's ``evaluate`` returned for the new model and those recorded when the
current model was published, logs :attr:`Decision.summary` and pushes
:meth:`Decision.as_dict` to XCom.

    gate = Gate(metric="val_loss", goal="minimize", threshold=0.5, min_improvement=0.01)
    gate.decide({"val_loss": 0.42}, {"val_loss": 0.45})   # publish: 0.42 <= 0.5, and 0.03 better

Rules (both must hold when both are configured):

* ``threshold``: maximize -> value >= threshold; minimize -> value <= threshold.
* ``min_improvement`` (None: the published model is not consulted): the new value must be
  better than the published model's by at least that much (maximize: value - baseline >=
  min_improvement; minimize: baseline - value >= min_improvement). 0 means "no worse".
  With no published model yet (the first run) there is nothing to beat.
* ``tolerance`` / ``relative_tolerance`` (instead of a positive ``min_improvement``): the new value
  may be worse than the published model's by at most the larger of ``tolerance`` (absolute) and
  ``relative_tolerance`` times the published value's magnitude (``0.005``: "no worse than 0.5%"),
  as :func:`math.isclose` combines its two tolerances. Evaluation is noisy: a model retrained on
  the same data scores a little differently each time, so "no worse" alone refuses good models
  about half the time. Choose the tolerance from that spread: evaluate a few retrainings of the
  same date (or look at the published models' metric over quiet dates) and allow about two
  standard deviations (docs/gate.md, "Choosing a tolerance").

    gate = Gate(metric="f1", goal="maximize", relative_tolerance=0.005)
    gate.decide({"f1": 0.9849}, {"f1": 0.988})  # publish: worse by 0.0031, within tolerance 0.00494 (0.5% of 0.988)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from dtrain.errors import SpecError

GOALS = ("maximize", "minimize")


def metric_value(metrics: Any, metric: str, source: str) -> float:
    """``metrics[metric]`` as a finite float; SpecError naming ``source`` otherwise (NaN never passes a gate)."""
    if not isinstance(metrics, Mapping):
        raise SpecError(source, metrics, f"a dict of metrics containing {metric!r}")
    if metric not in metrics:
        raise SpecError(f"{source}[{metric!r}]", None,
                        f"a number; the metrics given are {', '.join(map(str, metrics)) or 'none'}")
    value = metrics[metric]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"{source}[{metric!r}]", value, "a finite number")
    return float(value)


@dataclass(frozen=True)
class Decision:
    """What the gate decided, and every number it decided on."""

    publish: bool
    metric: str
    goal: str
    value: float
    threshold: float | None
    baseline: float | None  # the published model's value, when it was consulted and exists
    baseline_model: str | None
    min_improvement: float | None
    tolerance: float | None
    relative_tolerance: float | None
    reasons: tuple[str, ...]

    @property
    def summary(self) -> str:
        verdict = "publish" if self.publish else "do not publish"
        return f"gate: {verdict}: " + "; ".join(self.reasons)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["reasons"] = list(self.reasons)
        out["summary"] = self.summary
        return out


@dataclass(frozen=True)
class Gate:
    """Publish only a model good enough on one metric.

    Args:
        metric: the key of the metric in what ``evaluate`` returns (e.g. ``"rmse"``).
        goal: ``"maximize"`` (accuracy) or ``"minimize"`` (a loss, an error).
        threshold: absolute bar the value must reach (None: no bar).
        min_improvement: how much better than the published model the value must be
            (None: the published model is not consulted unless a tolerance is set; 0: no worse than it).
        tolerance: how much worse than the published model the value may be, absolute (None: 0).
        relative_tolerance: the same as a fraction of the published value's magnitude, in [0, 1)
            (None: 0). Either tolerance makes the gate consult the published model.
    """

    metric: str
    goal: str
    threshold: float | None = None
    min_improvement: float | None = None
    tolerance: float | None = None
    relative_tolerance: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise SpecError("metric", self.metric, "the name of a metric that evaluate returns")
        if self.goal not in GOALS:
            raise SpecError("goal", self.goal, "maximize or minimize")
        for name in ("threshold", "min_improvement", "tolerance", "relative_tolerance"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise SpecError(name, value, "a finite number, or None")
        if self.min_improvement is not None and self.min_improvement < 0:
            raise SpecError("min_improvement", self.min_improvement,
                            "a number >= 0 (how much better than the published model), or None; "
                            "to accept a slightly worse model set tolerance or relative_tolerance")
        if self.tolerance is not None and self.tolerance < 0:
            raise SpecError("tolerance", self.tolerance,
                            "a number >= 0 (how much worse than the published model is accepted), or None")
        if self.relative_tolerance is not None and not 0 <= self.relative_tolerance < 1:
            raise SpecError("relative_tolerance", self.relative_tolerance,
                            "a fraction in [0, 1) of the published value (0.005: no worse than 0.5%), or None")
        if self.tolerates and self.min_improvement:
            raise SpecError("min_improvement", self.min_improvement,
                            "0 or None when tolerance or relative_tolerance is set (a model cannot have to "
                            "be better and be allowed to be worse)")

    @property
    def tolerates(self) -> bool:
        """Whether a model somewhat worse than the published one may pass."""
        return self.tolerance is not None or self.relative_tolerance is not None

    @property
    def compares(self) -> bool:
        """Whether the published model is consulted at all."""
        return self.min_improvement is not None or self.tolerates

    def allowed_regression(self, baseline: float) -> float:
        """How much worse than ``baseline`` passes: the larger of the two tolerances."""
        return max(self.tolerance or 0.0, (self.relative_tolerance or 0.0) * abs(baseline))

    def _tolerance_text(self, baseline: float) -> str:
        allowed = f"tolerance {self.allowed_regression(baseline):.6g}"
        relative = f"{self.relative_tolerance * 100:.6g}% of {abs(baseline):.6g}" \
            if self.relative_tolerance is not None else None
        if relative and self.tolerance is not None:
            return f"{allowed} (the larger of {self.tolerance:.6g} and {relative})"
        return f"{allowed} ({relative})" if relative else allowed

    def _better_by(self, value: float, baseline: float) -> float:
        """How much better ``value`` is than ``baseline`` (negative: worse), whichever the goal."""
        return value - baseline if self.goal == "maximize" else baseline - value

    def decide(self, metrics: Mapping[str, Any], published: Mapping[str, Any] | None = None,
               published_model: str | None = None) -> Decision:
        """Decide on the new model's ``metrics`` given the published model's (None: none published)."""
        value = metric_value(metrics, self.metric, "evaluate()")
        reasons: list[str] = []
        ok = True
        if self.threshold is not None:
            passed = value >= self.threshold if self.goal == "maximize" else value <= self.threshold
            op = (">=" if passed else "<") if self.goal == "maximize" else ("<=" if passed else ">")
            reasons.append(f"{self.metric} {value:.6g} {op} threshold {self.threshold:.6g}")
            ok = ok and passed
        baseline = None
        if self.compares:
            if published is None:
                reasons.append("no published model to compare with")
            else:
                baseline = metric_value(published, self.metric, "the published model's metrics")
                better = self._better_by(value, baseline)
                direction = "higher" if self.goal == "maximize" else "lower"
                compared = f"{self.metric} {value:.6g} vs published {baseline:.6g}: {_by(better)} ({direction} is better)"
                if self.tolerates:
                    passed = better >= -self.allowed_regression(baseline)
                    rule = f"{'within' if passed else 'beyond'} {self._tolerance_text(baseline)}"
                else:
                    passed = better >= self.min_improvement
                    rule = f"{'at least' if passed else 'less than'} min_improvement {self.min_improvement:.6g}"
                reasons.append(f"{compared}, {rule}")
                ok = ok and passed
        if not reasons:
            reasons.append(f"{self.metric} {value:.6g}, no bar set")
        return Decision(publish=ok, metric=self.metric, goal=self.goal, value=value, threshold=self.threshold,
                        baseline=baseline, baseline_model=published_model if baseline is not None else None,
                        min_improvement=self.min_improvement, tolerance=self.tolerance,
                        relative_tolerance=self.relative_tolerance, reasons=tuple(reasons))


def _by(better: float) -> str:
    """A difference in words, so that an improvement never reads like a regression whatever the goal."""
    if better == 0:
        return "the same"
    return f"{'better' if better > 0 else 'worse'} by {abs(better):.6g}"
