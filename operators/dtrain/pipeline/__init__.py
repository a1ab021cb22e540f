"""The retraining pipeline: :func:`retraining_pipeline` builds your own retraining DAG.

    from dtrain.pipeline import retraining_pipeline, model_asset

The factory (and so Airflow) is imported on first use of those names only: the pipeline's
Airflow-free modules (params, gate, publish, steps) import this package too.
"""

from __future__ import annotations

from typing import Any

__all__ = ["retraining_pipeline", "model_asset", "dataset_asset"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dtrain.pipeline import factory

        return getattr(factory, name)
    raise AttributeError(f"module 'dtrain.pipeline' has no attribute {name!r}")
