"""What :func:`~dtrain.pipeline.factory.retraining_pipeline` is given: one frozen dataclass per thing you decide.

    from dtrain.pipeline import DataConfig, GateConfig, PublishConfig, TrainingConfig

* :class:`DataConfig`: where the raw data is, how it is preprocessed and packed, where it is staged;
* :class:`TrainingConfig`: how training runs (command, params, placement, the train operator's arguments);
* :class:`GateConfig`: how a trained model is evaluated and when it is published (metric, bar, approval);
* :class:`PublishConfig`: where published models go (the model registry).

Each checks its own fields when it is built (a :class:`~dtrain.errors.SpecError` naming the field, the
value and what is allowed), so a mistake fails the DAG file when it is parsed. Checks that need the
pipeline as a whole (a ``{params.NAME}`` placeholder naming a param) are the factory's.

:func:`configs_from_keywords` turns the factory's older flat keywords (``metric=...``) into these,
with a DeprecationWarning naming each keyword's new home.

Airflow-free: a DAG file's configs are checked without the scheduler's machinery.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dtrain.errors import SpecError
from dtrain.launch.core.spec_options import JOB_OPTIONS
from dtrain.pipeline.gate import Gate
from dtrain.pipeline.params import DATASET_VERSION_PATTERN
from dtrain.pipeline.registry import ModelRegistry
from dtrain.preprocess.packing import Packing, packing_option
from dtrain.preprocess.transform import REF


def _job_options(*names: str) -> tuple[str, ...]:
    """The train operator's job options ``names``, each looked up in JOB_OPTIONS: an option renamed there
    fails this module's import (a DAG file's parse), not a run."""
    return tuple(JOB_OPTIONS[name].name for name in names)


#: the job options every pipeline has as params (the UI's placement)
PLACEMENT_PARAMS = _job_options("nodes", "procs_per_node", "distribution", "backend")
#: the params every pipeline has; a user param may not reuse these names
BUILTIN_PARAMS = (*PLACEMENT_PARAMS, "dataset_version")
#: train operator arguments the factory sets itself (so they cannot be given in operator_args)
SET_BY_FACTORY = frozenset({"task_id", "command", *PLACEMENT_PARAMS,
                            *_job_options("backend_options", "deepspeed_config", "run_dir", "env"),
                            "dag", "outlets", "pre_execute"})
MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
PARAM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
BACKENDS = ("local", "ssh", "slurm")


def _import_path(field: str, value: Any) -> str:
    if not isinstance(value, str) or not REF.match(value):
        raise SpecError(field, value, "a literal import path MODULE:FUNCTION, e.g. mypkg.eval:evaluate "
                                      "(imported where the task runs, not when the DAG is parsed)")
    return value


def _location(field: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise SpecError(field, value, "a URL or path (a non-empty string)")


def _check_seconds(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 3600:
        raise SpecError(field, value, "a number of seconds from 1 to 3600")
    return float(value)


def _check_command(command: Any) -> tuple[str, ...]:
    if isinstance(command, str) or not isinstance(command, Sequence) or not command \
            or not all(isinstance(a, str) for a in command):
        raise SpecError("command", command, "a non-empty list of strings (argv: no shell)")
    return tuple(command)


def _check_param_names(params: Mapping[str, Any] | None) -> None:
    if params is not None and not isinstance(params, Mapping):
        raise SpecError("params", params, "a dict of param name -> Param or default value, or None")
    for name in params or {}:
        if not isinstance(name, str) or not PARAM_NAME.fullmatch(name):
            raise SpecError("params", name, "param names that are Python identifiers (they appear as {params.NAME})")
        if name in BUILTIN_PARAMS:
            raise SpecError("params", name, f"a name other than the built-in params {', '.join(BUILTIN_PARAMS)}")


def _mapping_or_none(field: str, value: Any) -> None:
    if value is not None and not isinstance(value, Mapping):
        raise SpecError(field, value, "a dict, or None")


@dataclass(frozen=True)
class DataConfig:
    """Where a pipeline's data is, how it is preprocessed, and where it is staged for training.

    Fields:
        raw: URL of the raw data; a run reads every file of ``<raw>/<dataset_version>/<partition>/``.
        processed: URL the preprocessed shards are written under, as ``<processed>/<dag_id>/<version>/<partition>``.
        shared_fs: the filesystem every training node mounts (datasets, runs and, by default, models go there).
        transform: ``module:function`` applied to every raw record (a dict of arrays out, None to drop it).
        pack: ``{"field", "block_size", "separator"}``: a token field packed into blocks (None: a sample a record).
        dataset_version: the ``dataset_version`` param's default (the raw data's ``<version>`` directory).
        aws_conn_id: Airflow connection for s3:// raw, processed and held-out locations (and the ranks' S3 access).
        epoch_seconds: staging sizes the shared filesystem for one epoch in this many seconds (None: no sizing).

    Datasets are staged to ``<shared_fs>/datasets/<dag_id>/<version>/<partition>``; packing is
    :mod:`dtrain.preprocess.packing`.
    """

    raw: str
    processed: str
    shared_fs: str
    transform: str
    pack: Mapping[str, Any] | Packing | None = None
    dataset_version: str = "v1"
    aws_conn_id: str | None = "aws_default"
    epoch_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("raw", "processed", "shared_fs"):
            _location(name, getattr(self, name))
        _import_path("transform", self.transform)
        self.packing  # checked here: a mapped task's arguments reach its operator only at run time
        if not isinstance(self.dataset_version, str) or not re.match(DATASET_VERSION_PATTERN, self.dataset_version):
            raise SpecError("dataset_version", self.dataset_version,
                            "a version name: a letter or digit, then up to 63 of letters, digits, . _ -")

    @property
    def packing(self) -> Packing | None:
        """``pack`` checked (:func:`dtrain.preprocess.packing.packing_option`)."""
        return packing_option(self.pack)


@dataclass(frozen=True)
class TrainingConfig:
    """How a pipeline's training runs: the command on every rank, its params, where the ranks run.

    Fields:
        command: argv run on every rank (no shell), placeholders (``{shards}``, ``{params.NAME}`` ...) filled.
        params: your own run params (name -> Param or default) beside the built-in ones, used as ``{params.NAME}``.
        nodes: the ``nodes`` param's default (a count, or ``"MIN:MAX"`` for an elastic job).
        procs_per_node: the ``procs_per_node`` param's default (the GPU count on GPU nodes).
        backend: the ``backend`` param's default, one of ``backends``.
        backends: the backends a run may choose (the ``backend`` param's enum).
        backend_options: per-backend options, e.g. ``{"ssh": {"conn_id": "gpu_hosts"}}``.
        deepspeed_config: a DeepSpeed config; when given, a run may choose ``distribution=deepspeed``.
        env: extra environment for the ranks (added to what preflight recommends).
        min_free_gb: free space preflight requires on every node's run directory.
        earlier_dates_check_seconds: how often a ``train`` waiting for an earlier date looks again (1 to 3600).
        operator_args: further :class:`~dtrain.launch.airflow.operator.DistributedTrainingOperator` arguments.

    ``operator_args`` are the train task's own (``hang_timeout``, ``stop_grace``, ``max_restarts``,
    ``deferrable``, ``retry_policy``, ...); those the factory sets (:data:`SET_BY_FACTORY`) are refused.
    A waiting ``train`` frees its worker slot between checks (Airflow's reschedule): keep
    ``earlier_dates_check_seconds`` well above the time a worker takes to report a try's end, since
    Airflow 3.3's scheduler fails a rescheduled task whose next try it queued before it heard the
    previous one end; 5 s is too short where a task's supervisor takes 5.9 s to exit.
    """

    command: Sequence[str]
    params: Mapping[str, Any] | None = None
    nodes: int | str = 1
    procs_per_node: int = 1
    backend: str = "local"
    backends: Sequence[str] = BACKENDS
    backend_options: Mapping[str, Mapping[str, Any]] | None = None
    deepspeed_config: Mapping[str, Any] | None = None
    env: Mapping[str, str] | None = None
    min_free_gb: float = 1.0
    earlier_dates_check_seconds: float = 30.0
    operator_args: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", _check_command(self.command))
        _check_param_names(self.params)
        if isinstance(self.backends, str) or not isinstance(self.backends, Sequence) or not self.backends \
                or not set(self.backends) <= set(BACKENDS):
            raise SpecError("backends", self.backends, f"a non-empty list of {', '.join(BACKENDS)}")
        object.__setattr__(self, "backends", tuple(self.backends))
        if self.backend not in self.backends:
            raise SpecError("backend", self.backend, f"one of backends ({', '.join(self.backends)})")
        for name in ("backend_options", "deepspeed_config", "env", "operator_args"):
            _mapping_or_none(name, getattr(self, name))
        if isinstance(self.min_free_gb, bool) or not isinstance(self.min_free_gb, (int, float)) \
                or not math.isfinite(self.min_free_gb) or self.min_free_gb < 0:
            raise SpecError("min_free_gb", self.min_free_gb, "a number of GB >= 0")
        _check_seconds("earlier_dates_check_seconds", self.earlier_dates_check_seconds)
        clashing = sorted(SET_BY_FACTORY & set(self.operator_args or {}))
        if clashing:
            raise SpecError("operator_args", clashing[0], "an operator argument the factory does not set itself "
                                                          f"({', '.join(sorted(SET_BY_FACTORY))} are)")


@dataclass(frozen=True)
class GateConfig(Gate):
    """How a trained model is evaluated, and when it is published: the publish gate
    (:class:`~dtrain.pipeline.gate.Gate`, which checks the metric's fields) with its evaluation and approval.

    Fields:
        metric: the key of the metric in what ``evaluate`` returns (e.g. ``"rmse"``).
        goal: ``"maximize"`` (accuracy) or ``"minimize"`` (a loss, an error).
        threshold: absolute bar the value must reach (None: no bar).
        min_improvement: how much better than the published model the value must be (0: no worse; None: not compared).
        tolerance: how much worse than the published model the value may be, absolute (None: 0).
        relative_tolerance: the same as a fraction in [0, 1) of the published value (``0.005``: no worse than 0.5%).
        evaluate: ``module:function``, called as ``evaluate(model_path, heldout)`` on the worker: a dict of metrics.
        heldout: the held-out data ``evaluate`` gets (``{version}``, ``{partition}``, ``{params.NAME}`` filled).
        approval: ask a person (Airflow's ApprovalOperator) before publishing a model the gate passed.
        approval_timeout: how long to wait for that answer (None: no limit); no answer, no publish.
    """

    evaluate: str = dataclasses.field(kw_only=True)
    heldout: str | None = dataclasses.field(default=None, kw_only=True)
    approval: bool = dataclasses.field(default=False, kw_only=True)
    approval_timeout: dt.timedelta | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _import_path("evaluate", self.evaluate)
        super().__post_init__()
        if self.heldout is not None and not isinstance(self.heldout, str):
            raise SpecError("heldout", self.heldout, "a location (text with placeholders), or None")
        if not isinstance(self.approval, bool):
            raise SpecError("approval", self.approval, "True or False")
        if self.approval_timeout is not None and (not isinstance(self.approval_timeout, dt.timedelta)
                                                  or self.approval_timeout <= dt.timedelta(0)):
            raise SpecError("approval_timeout", self.approval_timeout, "a positive datetime.timedelta, or None")

    @property
    def rule(self) -> Gate:
        """The publish gate alone (what the gate task decides with)."""
        return Gate(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Gate)})


@dataclass(frozen=True)
class PublishConfig:
    """Where a pipeline publishes its models, and what its gate compares with.

    Fields:
        models: the default registry's root, ``<models>/<dag_id>/<version>/<partition>/`` (None: <shared_fs>/models).
        model_name: the file or directory name ``{output}`` ends with and the published model has.
        registry: a :class:`~dtrain.pipeline.registry.ModelRegistry` (None: a ``DirectoryRegistry`` under ``models``).

    An MLflow model registry (``MlflowRegistry``) also makes every train task an MLflow run (docs/mlflow.md).
    """

    models: str | None = None
    model_name: str = "model.pt"
    registry: ModelRegistry | None = None

    def __post_init__(self) -> None:
        if self.models is not None:
            _location("models", self.models)
        if not isinstance(self.model_name, str) or not MODEL_NAME.fullmatch(self.model_name):
            raise SpecError("model_name", self.model_name, "a file or directory name (letters, digits, _ . + -)")
        if self.registry is not None and not isinstance(self.registry, ModelRegistry):
            raise SpecError("registry", self.registry, "a dtrain.pipeline.registry.ModelRegistry (DirectoryRegistry, "
                                                       "MlflowRegistry), or None for the directory default")


# -- the older flat keywords: one release of deprecation ------------------------------------------------

#: each config: the factory's argument that takes it, and its class
CONFIGS = {"data": DataConfig, "training": TrainingConfig, "gate": GateConfig, "publish": PublishConfig}
#: a flat keyword whose config field has another name
RENAMED = {"train_command": "command"}
#: the flat keyword -> the factory argument whose config holds it
FLAT_KEYWORDS = {
    **{f.name: "data" for f in dataclasses.fields(DataConfig)},
    **{f.name: "training" for f in dataclasses.fields(TrainingConfig) if f.name not in ("command", "operator_args")},
    "train_command": "training",
    **{f.name: "gate" for f in dataclasses.fields(GateConfig)},
    **{f.name: "publish" for f in dataclasses.fields(PublishConfig)},
}


def _new_home(keyword: str) -> tuple[str, str]:
    """(the factory argument, how the keyword is written inside its config) for a flat keyword."""
    argument = FLAT_KEYWORDS.get(keyword, "training")
    if keyword in FLAT_KEYWORDS:
        return argument, f"{RENAMED.get(keyword, keyword)}=..."
    return argument, f"operator_args={{{keyword!r}: ...}}"  # a train operator argument


def configs_from_keywords(given: Mapping[str, Any], flat: Mapping[str, Any]) -> dict[str, Any]:
    """The configs the factory was given (``given``: argument -> config or None), with those the flat
    keywords ``flat`` make: one DeprecationWarning per keyword naming its new home; a flat keyword
    beside the config that holds it is refused; a keyword that is no config field is a train operator
    argument (``operator_args``)."""
    grouped: dict[str, dict[str, Any]] = {name: {} for name in CONFIGS}
    for keyword, value in flat.items():
        argument, field = _new_home(keyword)
        cls = CONFIGS[argument].__name__
        if given[argument] is not None:
            raise SpecError(keyword, value, f"not both retraining_pipeline({keyword}=...) and {argument}={cls}(...): "
                                            f"give it as {argument}={cls}({field})")
        warnings.warn(f"retraining_pipeline({keyword}=...) is deprecated: use {argument}={cls}({field})",
                      DeprecationWarning, stacklevel=3)
        if keyword in FLAT_KEYWORDS:
            grouped[argument][RENAMED.get(keyword, keyword)] = value
        else:
            grouped[argument].setdefault("operator_args", {})[keyword] = value
    configs = {}
    for argument, cls in CONFIGS.items():
        config = given[argument]
        if config is None and (grouped[argument] or argument == "publish"):
            config = cls(**grouped[argument])
        if not isinstance(config, cls):
            raise SpecError(argument, config, f"a dtrain.pipeline.{cls.__name__}(...)")
        configs[argument] = config
    return configs
