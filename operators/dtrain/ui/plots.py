"""Plots as SVG, drawn on the server by matplotlib: the pages need no script library and no internet.

Every series is a group whose id names it (``<curve>-rank<R>``, ``<dag_id>-published``), so a page,
a test or a person's browser tools can tell the series apart in the DOM. matplotlib is imported
on the first plot (never on the DAG-parse path); drawing is serialized because pyplot's state
is global.
"""

from __future__ import annotations

import io
import re
import statistics
import threading
from typing import Mapping, Sequence

_LOCK = threading.Lock()
_ID_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")
WIDTH_IN, HEIGHT_IN = 5.6, 2.8
#: ranks drawn one line each; more are drawn as their envelope (min, median, max per step): 512 lines
#: and a legend of 512 entries cost seconds to draw and show nothing a reader can tell apart
#: (bench/ui_refresh.py --plot-ranks compares the two)
MAX_RANK_LINES = 16
#: points of an envelope: the SVG is about 540 px wide
MAX_ENVELOPE_POINTS = 500


def series_id(*parts: str) -> str:
    """An id usable in HTML and CSS selectors from untrusted parts (DAG ids, curve names)."""
    return "-".join(_ID_SAFE.sub("_", part) for part in parts)


def _figure():
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    # Fixed margins: matplotlib's "constrained" layout solves for them on every draw, half of a
    # plot's cost, and a page refresh draws three (bench/ui_refresh.py).
    figure = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=96)
    figure.subplots_adjust(left=0.13, right=0.98, top=0.88, bottom=0.16)
    return figure, figure.add_subplot()


def _svg(figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # inline in a page: no XML declaration or doctype


def envelope(by_rank: Mapping[str, Sequence[Sequence[float]]],
             max_points: int = MAX_ENVELOPE_POINTS) -> list[tuple[float, float, float, float]]:
    """``(step, min, median, max)`` of the ranks' values, step by step; when the ranks logged more
    distinct steps than ``max_points`` (thinned differently), the steps are pooled into that many
    equal spans, each at its last step."""
    by_step: dict[float, list[float]] = {}
    for points in by_rank.values():
        for step, value in points:
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    if len(steps) > max_points:
        first, width = steps[0], (steps[-1] - steps[0]) / max_points
        pooled: dict[int, list[float]] = {}
        last: dict[int, float] = {}
        for step in steps:
            span = min(int((step - first) / width), max_points - 1)
            pooled.setdefault(span, []).extend(by_step[step])
            last[span] = step
        by_step = {last[span]: values for span, values in pooled.items()}
        steps = sorted(by_step)
    return [(step, min(v), statistics.median(v), max(v)) for step in steps for v in (by_step[step],)]


def rank_curves(curve: str, title: str, ylabel: str, by_rank: Mapping[str, Sequence[Sequence[float]]],
                rounds: Sequence[tuple[int, int, int]] = (), max_lines: int = MAX_RANK_LINES) -> str:
    """One line per rank: x = step, y = the curve's value; the line's group id is ``<curve>-rank<R>``.
    Beyond ``max_lines`` ranks, their envelope instead (:func:`envelope`): the band from the lowest
    to the highest rank's value (group id ``<curve>-ranks-range``) and the median line
    (``<curve>-ranks-median``).

    ``rounds``: an elastic job's rounds as (round, world size, resume step), each a dashed vertical
    marker at its resume step labelled ``round N: W ranks`` (group id ``<curve>-round<N>``), so a
    rank's line is seen to end or start at a round. Rounds that resumed from the same step share
    one label."""
    with _LOCK:
        figure, ax = _figure()
        labels: dict[int, list[str]] = {}
        for number, world_size, step in rounds:
            ax.axvline(step, color="#718096", linestyle="--", linewidth=0.9, zorder=1,
                       gid=series_id(curve, f"round{number}"))
            labels.setdefault(step, []).append(f"round {number}: {world_size} ranks")
        for step, texts in labels.items():
            ax.text(step, 0.98, ", ".join(texts), transform=ax.get_xaxis_transform(), rotation=90, ha="right",
                    va="top", fontsize=6, color="#4a5568", parse_math=False, gid=series_id(curve, f"round-label{step}"))
        if len(by_rank) > max_lines:
            _draw_envelope(ax, curve, by_rank)
        else:
            for rank in sorted(by_rank, key=int):
                points = by_rank[rank]
                ax.plot([p[0] for p in points], [p[1] for p in points], label=f"rank {rank}", linewidth=1.2,
                        marker="o" if len(points) < 30 else None, markersize=2.5, gid=series_id(curve, f"rank{rank}"))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if by_rank:
            ax.legend(fontsize=7, ncols=min(4, len(ax.get_legend_handles_labels()[1])), loc="best")
        else:
            ax.text(0.5, 0.5, "no metrics yet", ha="center", va="center", transform=ax.transAxes, fontsize=9)
        return _svg(figure)


def _draw_envelope(ax, curve: str, by_rank: Mapping[str, Sequence[Sequence[float]]]) -> None:
    steps, low, median, high = zip(*envelope(by_rank))
    ax.fill_between(steps, low, high, color="#90cdf4", alpha=0.5, linewidth=0,
                    label=f"lowest to highest of {len(by_rank)} ranks", gid=series_id(curve, "ranks-range"))
    ax.plot(steps, median, color="#2b6cb0", linewidth=1.2, label="median rank", gid=series_id(curve, "ranks-median"))


def partition_metric(dag_id: str, metric: str, points: Sequence[Mapping]) -> str:
    """The gate's metric per partition: published models joined by a line, gated-out runs as crosses.

    ``points``: ``{"partition": "YYYY-MM-DD", "value": float, "published": bool}``."""
    import datetime as dt

    with _LOCK:
        figure, ax = _figure()
        for published, style in ((True, {"marker": "o", "linestyle": "-", "label": "published"}),
                                 (False, {"marker": "x", "linestyle": "none", "label": "gated out",
                                          "markersize": 7})):
            chosen = sorted((p for p in points if bool(p["published"]) is published), key=lambda p: p["partition"])
            if chosen:
                ax.plot([dt.date.fromisoformat(p["partition"]) for p in chosen], [p["value"] for p in chosen],
                        gid=series_id(dag_id, "published" if published else "gated-out"), **style)
        if points:
            _date_ticks(ax, sorted({p["partition"] for p in points}))
        else:  # no dates: an empty date axis would label 1970-01-01 (day 0 of matplotlib's epoch)
            ax.set_xticks([])
        # The metric's name comes from a recorded decision (an XCom anyone who may edit the run can
        # change): plain text, never mathtext ("$\\foo$" would fail to parse and fail the page).
        ax.set_title(f"{dag_id}: {metric} per partition", fontsize=10, parse_math=False)
        ax.set_ylabel(metric, fontsize=8, parse_math=False)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if points:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no evaluated run yet", ha="center", va="center", transform=ax.transAxes, fontsize=9)
        return _svg(figure)


def _date_ticks(ax, partitions: Sequence[str]) -> None:
    """Partitions are days: label days, one tick per partition while they fit."""
    import datetime as dt

    from matplotlib import dates

    if 0 < len(partitions) <= 10:
        ax.set_xticks([dt.date.fromisoformat(p) for p in partitions])
    else:
        ax.xaxis.set_major_locator(dates.AutoDateLocator(minticks=3, maxticks=10))
    ax.xaxis.set_major_formatter(dates.DateFormatter("%Y-%m-%d"))
    for label in ax.get_xticklabels():
        label.set_rotation(30)
        label.set_horizontalalignment("right")
