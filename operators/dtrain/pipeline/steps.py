"""What the pipeline's Python tasks do, outside Airflow: list a partition's raw files, run the
user's ``evaluate``, decide with the gate, publish. Called from the tasks the factory builds
(:mod:`dtrain.pipeline.factory`); imported only when those tasks run, never at DAG parse.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from dtrain.errors import DTrainError, SpecError
from dtrain.pipeline.gate import Decision, Gate
from dtrain.pipeline.registry import ModelRegistry


class EvaluateError(DTrainError):
    """The user's evaluate function failed or returned something the gate cannot use."""


class NoRawData(DTrainError, FileNotFoundError):
    """A partition has no raw files: nothing to preprocess, train or publish for it."""


class EarlierDateRunning(DTrainError):
    """A run of an earlier date is still running: this date trains once it has ended."""


class EarlierDateBlocking(DTrainError):
    """A run of an earlier date failed or has not started: this date must not train before it."""


def list_raw_inputs(raw_url: str, aws_conn_id: str | None) -> list[str]:
    """The raw files of one partition (hidden files skipped), as URLs: one preprocessing task each."""
    import fsspec

    from dtrain.hooks.aws import aws_storage_options

    options = aws_storage_options(aws_conn_id) if raw_url.startswith("s3://") and aws_conn_id else {}
    fs, root = fsspec.core.url_to_fs(raw_url, **options)
    protocol = raw_url.split("://", 1)[0] + "://" if "://" in raw_url else ""
    files = sorted(p for p in fs.find(root) if not os.path.basename(p).startswith("."))
    if not files:
        raise NoRawData(f"no raw data at {raw_url}: nothing to train on for this partition")
    return [protocol + p if protocol and not p.startswith(protocol) else p for p in files]


def _date(run: Any) -> str:
    return run.logical_date.strftime("%Y-%m-%d") if run.logical_date else "?"


def check_earlier_dates(running: Any, queued: Any, previous: Any) -> None:
    """May this date train now? Raise if not, with what the user sees and can do.

    The arguments are the newest earlier-dated run (by logical date) of the DAG that is running, that
    is queued, and of any state (objects with ``run_id``, ``logical_date``, ``state``; None if there
    is none). Once no earlier run is running, every earlier date has published its model or been
    gated out, so ``{init_from}`` and the gate's baseline are the newest model published before this
    date, whatever the backfill's concurrency.

    Raises:
        EarlierDateRunning: an earlier run is still running (wait for it: it will end by itself).
        EarlierDateBlocking: the previous run failed, or an earlier one has not started: waiting for
            it could hold the run slot it needs (``max_active_runs``), so this run fails instead and
            the message says how to go on.
    """
    if running is not None:
        raise EarlierDateRunning(
            f"train waits for the run of {_date(running)} ({running.run_id}), still running: each date trains "
            "after every earlier date has published its model or been gated out, so that it warm-starts from "
            "and is gated against the newest model before it (this date's data is already staged)")
    if queued is not None:
        raise EarlierDateBlocking(
            f"the run of {_date(queued)} ({queued.run_id}) has not started (queued), and a date trains only after "
            "every earlier date: this run fails rather than hold a run slot the earlier one may need. Once "
            f"{_date(queued)} has finished, clear this run's train task (backfills run forward: no --run-backwards)")
    if previous is not None and str(getattr(previous.state, "value", previous.state)) == "failed":
        date = _date(previous)
        raise EarlierDateBlocking(
            f"the run of {date} ({previous.run_id}) failed, so its model was neither published nor gated out, "
            f"and this date would warm-start from and be gated against a model older than {date}. To go on: "
            f"rerun {date} (clear its failed tasks), then clear this run's train task; or, to train without "
            f"{date}'s model, mark the run of {date} as success and clear this run's train task")


def _json_scalar(name: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:  # numpy and torch scalars
        return value.item()
    except AttributeError:
        raise EvaluateError(f"evaluate() returned {name}={value!r}: metrics must be numbers "
                            "(or text, booleans, None)") from None


def evaluate_model(evaluate: Callable[[str, str | None], Any], model_path: str, heldout: str | None,
                   metric: str) -> dict[str, Any]:
    """Call the user's ``evaluate(model_path, heldout)``; its metrics as JSON scalars, ``metric`` checked."""
    if not os.path.exists(model_path):
        raise EvaluateError(f"no model at {model_path}: the training command did not write its model to {{output}}")
    metrics = evaluate(model_path, heldout)
    if not isinstance(metrics, Mapping):
        raise EvaluateError(f"evaluate() returned {type(metrics).__name__}, not a dict of metrics")
    clean = {str(k): _json_scalar(str(k), v) for k, v in metrics.items()}
    from dtrain.pipeline.gate import metric_value

    try:
        metric_value(clean, metric, "evaluate()")
    except SpecError as e:
        raise EvaluateError(str(e)) from None
    return clean


def decide_with(gate: Gate, metrics: Mapping[str, Any], registry: ModelRegistry, version: str,
                partition: str) -> Decision:
    """The gate's decision against the registry's baseline for ``partition`` (dtrain.pipeline.registry)."""
    found = registry.baseline(version, partition) if gate.compares else None
    if found is None:
        return gate.decide(metrics, None)
    return gate.decide(metrics, found.metrics, published_model=found.model)
