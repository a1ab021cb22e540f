"""``from dtrain.pipeline.registry_mlflow import MlflowRegistry`` keeps working for DAG files that use it:
the registry is :class:`dtrain.mlflow.registry.MlflowRegistry` (docs/mlflow.md)."""

from dtrain.mlflow.registry import MlflowRegistry

__all__ = ["MlflowRegistry"]
