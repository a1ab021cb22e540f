"""The retraining pipeline: :func:`retraining_pipeline` builds your own retraining DAG from its configs.

    from dtrain.pipeline import DataConfig, GateConfig, PublishConfig, TrainingConfig, retraining_pipeline

The factory (and so Airflow) is imported on first use of those names only: the pipeline's
Airflow-free modules (params, gate, publish, steps, configs) import this package too.
"""

from __future__ import annotations

from typing import Any

_FACTORY = ("retraining_pipeline", "model_asset", "dataset_asset")
_CONFIGS = ("DataConfig", "TrainingConfig", "GateConfig", "PublishConfig")
__all__ = [*_FACTORY, *_CONFIGS]


def __getattr__(name: str) -> Any:
    if name in _FACTORY:
        from dtrain.pipeline import factory

        return getattr(factory, name)
    if name in _CONFIGS:
        from dtrain.pipeline import configs

        return getattr(configs, name)
    raise AttributeError(f"module 'dtrain.pipeline' has no attribute {name!r}")
