"""Text for people: the approval request's body (Markdown), from what evaluate and the gate pushed.

Every value in it comes from user code or a rank (metric names and values, paths) and must read
as the text it is: a reviewer deciding to publish must not see a link ("Approve: model
verified"), a heading ("Gate: PASSED") or emphasis that the value wrote. Two renderings, by place:

* text (the verdict line, table cells): control characters (CR and LF are line endings to
  Markdown, so ``\\r# Gate`` would start a heading) become spaces, and every character that starts
  an inline construct of CommonMark or GitHub's tables is escaped (:data:`ESCAPED`);
* paths: a code span, fenced with more backticks than any run in the value, inside which
  CommonMark interprets nothing.

A value never starts a line (it always follows our own label or ``|``), so line-start constructs
(``#``, ``>``, ``-``, ``1.``) cannot form.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

#: the longest value shown, cut before it is escaped (an escape is never cut in half)
MAX_VALUE_CHARS = 200
#: control characters, CR and LF included: a space each
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: inline constructs and what starts them: escapes (\), code spans (`), emphasis and
#: strikethrough (* _ ~), links and images ([ ]), table cells (|), entities (&). An ``_`` between
#: two letters or digits can neither open nor close emphasis (CommonMark's flanking rules), so
#: ``min_improvement`` stays as it is
ESCAPED = re.compile(r"([\\`*~\[\]|&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
BACKTICKS = re.compile(r"`+")


def _plain(value: Any) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return CONTROL.sub(" ", text[:MAX_VALUE_CHARS])


def _cell(value: Any) -> str:
    """``value`` as Markdown text that renders as itself (raw HTML and autolinks start with ``<``)."""
    return ESCAPED.sub(r"\\\1", _plain(value)).replace("<", "&lt;")


def _code(value: Any) -> str:
    """``value`` as a code span: nothing in it is interpreted, whatever backticks it holds."""
    text = _plain(value)
    fence = "`" * (max((len(run) for run in BACKTICKS.findall(text)), default=0) + 1)
    if text.startswith("`") or text.endswith("`"):
        text = f" {text} "  # CommonMark strips one space each side, so the value's own backtick stays inside
    return f"{fence}{text}{fence}"


def approval_markdown(evaluation: Mapping[str, Any] | None, decision: Mapping[str, Any] | None) -> str:
    """What a reviewer needs to approve a model: the gate's verdict, its numbers, every metric."""
    evaluation, decision = evaluation or {}, decision or {}
    lines = [f"**{_cell(decision.get('summary', 'gate: no decision recorded'))}**", "",
             "| | value |", "|---|---|"]
    for label, key in (("metric", "metric"), ("goal", "goal"), ("new model", "value"), ("threshold", "threshold"),
                       ("published model", "baseline"), ("min_improvement", "min_improvement"),
                       ("tolerance", "tolerance"), ("relative_tolerance", "relative_tolerance")):
        if decision.get(key) is not None:
            lines.append(f"| {label} | {_cell(decision[key])} |")
    metrics = evaluation.get("metrics") or {}
    if metrics:
        lines += ["", "| metric | new model |", "|---|---|"]
        lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in sorted(metrics.items())]
    for label, key in (("trained model", "model_path"), ("run directory", "run_dir"), ("held-out data", "heldout")):
        if evaluation.get(key):
            lines.append(f"\n{label}: {_code(evaluation[key])}")
    if decision.get("baseline_model"):
        lines.append(f"\npublished model compared with: {_code(decision['baseline_model'])}")
    return "\n".join(lines)
