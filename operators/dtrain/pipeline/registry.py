"""Where a retraining pipeline publishes its models, and what its gate compares with: the registry.

The factory's ``registry=`` argument takes one of these; each is one class:

* :class:`DirectoryRegistry` (the default): ``<models>/<dag_id>/<version>/<date>/{model, metrics.json}``
  on a filesystem (dtrain.pipeline.publish); the gate compares with the newest model published
  before the run's date.
* :class:`~dtrain.pipeline.registry_mlflow.MlflowRegistry`: an MLflow tracking server's model
  registry; the gate compares with the version holding the ``champion`` alias, and every train
  task is an MLflow run (docs/mlflow.md).

A third (SageMaker Model Registry, a database table) implements :class:`ModelRegistry`'s abstract
methods. Every method runs on the Airflow worker, in a task, never at DAG parse; the constructor
stores its arguments only (Airflow parses DAG files often).
"""

from __future__ import annotations

import copy
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Pipeline:
    """What the factory tells a registry about the pipeline using it."""

    dag_id: str
    shared_fs: str
    model_name: str
    models: str | None = None  # the factory's ``models`` argument


@dataclass(frozen=True)
class RunRef:
    """One DAG run of the pipeline, as a task sees it."""

    run_id: str
    clear_number: int
    version: str  # the dataset_version param
    partition: str  # YYYY-MM-DD


@dataclass(frozen=True)
class Baseline:
    """The model the gate compares with: a reference people can read, and its recorded metrics."""

    model: str
    metrics: Mapping[str, Any]


@dataclass(frozen=True)
class Published:
    """What publish did: ``record`` goes to XCom (the Retraining page reads it), ``asset_extra`` to
    the model asset's event, ``summary`` to the task log."""

    record: dict[str, Any]
    asset_extra: dict[str, Any]
    summary: str = ""


class ModelRegistry(ABC):
    """Publishing and the gate's baseline, for one pipeline (:meth:`for_pipeline` binds it)."""

    pipeline: Pipeline

    def for_pipeline(self, pipeline: Pipeline) -> "ModelRegistry":
        """A copy bound to ``pipeline``: one registry object may serve several DAGs."""
        bound = copy.copy(self)
        bound.pipeline = pipeline
        return bound

    @property
    def tracks_runs(self) -> bool:
        """Whether the train task records an experiment run (with :meth:`train_operator_class`'s
        operator, which then gets the registry and the run's params)."""
        return False

    def train_operator_class(self) -> type | None:
        """The pipeline's train task class for this registry; None: the plain
        :class:`~dtrain.launch.airflow.operator.DistributedTrainingOperator`."""
        return None

    @abstractmethod
    def warm_start(self, version: str, partition: str) -> str:
        """A local path of the model a run of ``partition`` starts from (``{init_from}``), or ''."""

    @abstractmethod
    def baseline(self, version: str, partition: str) -> Baseline | None:
        """The model the gate compares a run's model with, or None (nothing published yet)."""

    @abstractmethod
    def publish(self, run: RunRef, model_path: str, record: dict[str, Any]) -> Published:
        """Publish the model the gate (and the approver) passed; ``record``: metrics.json's content."""

    def record_evaluation(self, run: RunRef, evaluation: Mapping[str, Any]) -> None:
        """After evaluate: keep its metrics and the model with the run (registries that track runs)."""


class DirectoryRegistry(ModelRegistry):
    """Models on a filesystem: ``<models>/<dag_id>/<version>/<date>/{<model_name>, metrics.json}``.

    Args:
        models: the root (default: the factory's ``models`` argument, else ``<shared_fs>/models``).
    """

    def __init__(self, models: str | None = None):
        self.models = models

    @property
    def root(self) -> str:
        pipeline = self.pipeline
        base = self.models or pipeline.models or os.path.join(pipeline.shared_fs, "models")
        return os.path.join(base, pipeline.dag_id)

    def warm_start(self, version: str, partition: str) -> str:
        from dtrain.pipeline.publish import previous_model

        return previous_model(self.root, version, partition, self.pipeline.model_name)

    def baseline(self, version: str, partition: str) -> Baseline | None:
        from dtrain.pipeline.publish import previous_published

        found = previous_published(self.root, version, partition, self.pipeline.model_name)
        return None if found is None else Baseline(model=found[0], metrics=found[1].get("evaluation") or {})

    def publish(self, run: RunRef, model_path: str, record: dict[str, Any]) -> Published:
        from dtrain.pipeline.publish import publish_model

        done = publish_model(model_path, record, self.root, run.version, run.partition, self.pipeline.model_name)
        return Published(record=done, asset_extra={"model_path": done["model_path"],
                                                   "metrics_path": done["metrics_path"]},
                         summary=f"model: {done['model_path']} metrics: {done['metrics_path']}")
