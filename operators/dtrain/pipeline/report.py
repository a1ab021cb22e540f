"""Text for people: the approval request's body (Markdown), from what evaluate and the gate pushed."""

from __future__ import annotations

from typing import Any, Mapping


def _cell(value: Any) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    # Metric names and values come from user code: keep them from breaking the table or the page.
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")[:200]


def approval_markdown(evaluation: Mapping[str, Any] | None, decision: Mapping[str, Any] | None) -> str:
    """What a reviewer needs to approve a model: the gate's verdict, its numbers, every metric."""
    evaluation, decision = evaluation or {}, decision or {}
    lines = [f"**{_cell(decision.get('summary', 'gate: no decision recorded'))}**", "",
             "| | value |", "|---|---|"]
    for label, key in (("metric", "metric"), ("goal", "goal"), ("new model", "value"), ("threshold", "threshold"),
                       ("published model", "baseline"), ("min_improvement", "min_improvement")):
        if decision.get(key) is not None:
            lines.append(f"| {label} | {_cell(decision[key])} |")
    metrics = evaluation.get("metrics") or {}
    if metrics:
        lines += ["", "| metric | new model |", "|---|---|"]
        lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in sorted(metrics.items())]
    for label, key in (("trained model", "model_path"), ("run directory", "run_dir"), ("held-out data", "heldout")):
        if evaluation.get(key):
            lines.append(f"\n{label}: `{_cell(evaluation[key])}`")
    if decision.get("baseline_model"):
        lines.append(f"\npublished model compared with: `{_cell(decision['baseline_model'])}`")
    return "\n".join(lines)
