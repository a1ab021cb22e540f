"""``from dtrain.pipeline.registry_mlflow import MlflowRegistry``, deprecated: the registry is
:class:`dtrain.mlflow.registry.MlflowRegistry` (docs/mlflow.md). DAG files that use this path keep
working, with a DeprecationWarning. The name is resolved on first use, by name: the pipeline package
does not import the MLflow package, which is built on it.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = ["MlflowRegistry"]


def __getattr__(name: str) -> Any:
    if name != "MlflowRegistry":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn("dtrain.pipeline.registry_mlflow is deprecated: use `from dtrain.mlflow.registry import "
                  "MlflowRegistry`", DeprecationWarning, stacklevel=2)
    return importlib.import_module("dtrain.mlflow.registry").MlflowRegistry
