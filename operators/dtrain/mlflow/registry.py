"""MLflow's model registry as a retraining pipeline's registry, with every train task an MLflow run.

    from dtrain.mlflow.registry import MlflowRegistry

    dag = retraining_pipeline(..., publish=PublishConfig(registry=MlflowRegistry(
        "tabular-rmse", conn_id="mlflow_default", load_model="tabular_pipeline.evaluate:load_model")))

The rules (docs/mlflow.md):

* a run of date D starts from (``{init_from}``) and is gated against the model published just before
  D: the newest version of the run's dataset version whose partition (tag ``dtrain.partition``) is
  before D, as with the directory registry, whichever version holds ``champion``; its run's
  ``eval.<metric>`` is the gate's baseline; nothing published before D: nothing to beat;
* publish registers a new version whose source is the run's model artifact, then moves
  ``champion`` to it: two calls, so a failure between them leaves ``champion`` where it was, and a
  retry finds the version it registered (by run id) instead of registering a second one;
* a gated-out or rejected model is not registered at all: the registry holds only models someone
  could serve;
* a backfill never moves ``champion`` backwards: a version whose partition (tag
  ``dtrain.partition``) is older than the champion's is registered with the ``challenger`` alias and
  ``champion`` stays;
* ``{init_from}`` is that version's model file, downloaded once onto the shared filesystem.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import uuid
from typing import Any, Mapping, Sequence

from dtrain.errors import SpecError
from dtrain.grammar import MLFLOW_ALIAS, MLFLOW_VERSION, check
from dtrain.pipeline.registry import Baseline, ModelRegistry, Published, RunRef
from dtrain.preprocess.transform import REF
from dtrain.hooks.mlflow import TrackingServer
from dtrain.hooks.mlflow import tracking_uri as checked_uri
from dtrain.mlflow.tracking import (ensure_named, log_metrics, require_run, run_key, scalar_series,
                                    write_json_artifact)

#: artifact paths in each run: the model as the training command wrote it, and as an MLflow Model
TRAINED = "trained"
MLFLOW_MODEL = "model"
#: evaluate's metrics are logged as eval.<name>; the gate reads eval.<metric> of the champion's run
EVAL_PREFIX = "eval."
PARTITION_TAG = "dtrain.partition"
DATASET_VERSION_TAG = "dtrain.dataset_version"
#: versions read per request while looking for the one published before a date
PAGE_SIZE = 1000
#: inside the logged MLflow Model: the pipeline's named artifacts (``artifacts/<name>``)
ARTIFACTS_DIR = "artifacts"
ARTIFACT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
PACKAGE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: the model's classes from these packages load wherever the requirements are installed: never bundled
PROVIDED = frozenset({"torch", "builtins"})


def _alias(field_name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise SpecError(field_name, value, "an alias (text)")
    return check(field_name, value, MLFLOW_ALIAS, "an MLflow alias: letters, digits, _ and -, "
                                                  "not 'latest' or v<number> (MLflow reserves them)")


def _no_links(model_path: str) -> bool:
    """Whether the model (written by rank 0) is a directory; PublishError if it is, or holds, a link:
    uploading follows links, and a link to a worker's file must not become an artifact."""
    from dtrain.pipeline.publish import PublishError

    def refuse(path: str) -> None:
        raise PublishError(f"{path!r} is a symbolic link: the model must be regular files only")

    if os.path.islink(model_path):
        refuse(model_path)
    if not os.path.isdir(model_path):
        return False
    for folder, dirs, files in os.walk(model_path):
        for name in dirs + files:
            if os.path.islink(os.path.join(folder, name)):
                refuse(os.path.join(folder, name))
    return True


def _packages(value: Any) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise SpecError("registry code", value, "a list of top-level package names")
    for name in value:
        if not isinstance(name, str) or not PACKAGE_NAME.fullmatch(name):
            raise SpecError("registry code", name, "a top-level package name (an identifier)")
    return list(value)


def _requirements(value: Any) -> list[str]:
    from packaging.requirements import InvalidRequirement, Requirement

    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise SpecError("registry requirements", value, "a list of pip requirements such as 'tokenizers==0.22.1'")
    for item in value:
        try:
            if not isinstance(item, str) or "\n" in item:
                raise InvalidRequirement(repr(item))
            Requirement(item)
        except InvalidRequirement:
            raise SpecError("registry requirements", item, "a pip requirement such as 'tokenizers==0.22.1'") from None
    return list(value)


def _artifacts(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise SpecError("registry artifacts", value, "a mapping {name: path}")
    for name, path in value.items():
        if not isinstance(name, str) or not ARTIFACT_NAME.fullmatch(name):
            raise SpecError("registry artifacts", name, "a name of letters, digits, _ . - (at most 64)")
        if (not isinstance(path, str) or not path or "\x00" in path
                or (not os.path.isabs(path) and ".." in path.split(os.sep))):
            raise SpecError(f"registry artifacts[{name!r}]", path,
                            "a path: absolute, or relative to the run directory without '..'")
    return dict(value)


def own_packages(module) -> list[str]:
    """The top-level packages of the model's classes that a consumer would not have: all but torch's."""
    found = {type(sub).__module__.split(".")[0] for sub in module.modules()}
    return sorted(found - PROVIDED)


def _source_of(package: str) -> str:
    """Where a top-level package's code is on the worker (its folder, or a one-file module)."""
    import importlib.util

    from dtrain.pipeline.publish import PublishError

    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if len(locations) == 1:
        return locations[0]
    if spec is not None and not locations and spec.origin and os.path.isfile(spec.origin):
        return spec.origin
    raise PublishError(f"registry code {package!r}: not one importable package folder or module on the worker "
                       "(name the packages to bundle with code=[...], or list them in requirements)")


def _artifact_source(model_path: str, path: str) -> str:
    """An artifact's path: a relative one is in the run directory, which the ranks write, so no part of
    it may be a link (we never follow a link we did not make)."""
    from dtrain.pipeline.publish import PublishError

    if os.path.isabs(path):
        return path
    here = os.path.dirname(model_path)
    for part in path.split(os.sep):
        here = os.path.join(here, part)
        if os.path.islink(here):
            raise PublishError(f"{here!r} is a symbolic link: an artifact must be regular files only")
    return here


def _copy_artifact(name: str, source: str, destination: str) -> None:
    """Copy an artifact into the MLflow Model's folder (ours), following no link: a file is opened
    O_NOFOLLOW, a folder copied with its links as links and the copy then checked, so a link a rank
    swaps in after the first check is refused, never followed."""
    from dtrain.pipeline.publish import PublishError

    os.makedirs(os.path.dirname(destination), exist_ok=True)
    if _no_links(source):
        shutil.copytree(source, destination, symlinks=True)
        _no_links(destination)
        return
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not block us
    except OSError as e:
        raise PublishError(f"registry artifacts[{name!r}]: {source!r} is not a regular file or folder ({e.strerror})") from e
    with os.fdopen(fd, "rb") as src:
        if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
            raise PublishError(f"registry artifacts[{name!r}]: {source!r} is not a regular file or folder")
        with open(destination, "xb") as dst:
            shutil.copyfileobj(src, dst)


class MlflowRegistry(ModelRegistry):
    """An MLflow registered model as the registry; each train task an MLflow run.

    Args:
        model_name: the registered model's name (created on first publish).
        conn_id: an Airflow connection to the tracking server (type http or https; host, port,
            login/password; extra ``tracking_uri``, ``ui_url``): dtrain.hooks.mlflow.server_from_connection.
        tracking_uri: the server's URL instead of a connection (no credentials).
        experiment: the experiment runs go to (default: the DAG id).
        champion: the alias of the version that serves (default ``champion``).
        challenger: the alias of a backfilled version that did not take ``champion``.
        load_model: ``module:function`` returning the ``torch.nn.Module`` for a model path; when given,
            the model is also logged as an MLflow Model (PyTorch flavour), so consumers load it with
            ``mlflow.pytorch.load_model("models:/<name>@champion")`` and the version's source is it.
            Without it, the version's source is the trained file as the command wrote it.
        code: top-level packages whose source goes into the MLflow Model (``code/``), so that it
            loads where they are not installed (default: the packages of the model's own classes,
            torch's excepted). ``[]`` bundles nothing: then list your package in ``requirements``.
        requirements: pip requirements a consumer needs besides torch and MLflow (what your
            model's modules import, or your package's wheel), written into the model's
            ``requirements.txt``.
        artifacts: ``{name: path}`` of files or folders that travel with the model, such as a
            tokenizer: ``artifacts/<name>`` in the MLflow Model. A relative path is in the run
            directory (beside the trained model), an absolute one anywhere on the worker.
    """

    def __init__(self, model_name: str, *, conn_id: str | None = "mlflow_default", tracking_uri: str | None = None,
                 experiment: str | None = None, champion: str = "champion", challenger: str = "challenger",
                 load_model: str | None = None, code: Sequence[str] | None = None,
                 requirements: Sequence[str] = (), artifacts: Mapping[str, str] | None = None):
        self.model_name = ensure_named(model_name, "registry model_name")
        self.experiment = None if experiment is None else ensure_named(experiment, "registry experiment")
        self.champion = _alias("registry champion", champion)
        self.challenger = _alias("registry challenger", challenger)
        if self.champion == self.challenger:
            raise SpecError("registry challenger", challenger, f"an alias other than champion ({champion!r})")
        if tracking_uri is None and not conn_id:
            raise SpecError("registry conn_id", conn_id, "an Airflow connection id, or give tracking_uri")
        self.uri = None if tracking_uri is None else checked_uri(tracking_uri, "registry tracking_uri")
        self.conn_id = conn_id
        if load_model is not None and (not isinstance(load_model, str) or not REF.match(load_model)):
            raise SpecError("registry load_model", load_model, "an import path MODULE:FUNCTION")
        self.load_model = load_model
        self.code = None if code is None else _packages(code)
        self.requirements = _requirements(requirements)
        self.artifacts = _artifacts(artifacts or {})
        if not load_model and (code is not None or self.requirements or self.artifacts):
            raise SpecError("registry load_model", load_model, "an import path MODULE:FUNCTION when code, "
                            "requirements or artifacts are given: they travel in the MLflow Model it logs")

    # -- where the server is ------------------------------------------------------------------------

    @property
    def tracks_runs(self) -> bool:
        return True

    def train_operator_class(self) -> type:
        """The pipeline's train task for this registry: one MLflow run per train task
        (dtrain.mlflow.operator). The factory asks the registry, so the pipeline package never
        imports this one."""
        from dtrain.mlflow.operator import TrackedTrainingOperator

        return TrackedTrainingOperator

    @property
    def experiment_name(self) -> str:
        return self.experiment or self.pipeline.dag_id

    def server(self) -> TrackingServer:
        """Resolved when a task needs it (a connection is read on the worker, never at parse)."""
        if self.uri is not None:
            return TrackingServer(uri=self.uri, ui_url=self.uri)
        from dtrain.hooks.mlflow import tracking_server

        return tracking_server(self.conn_id)

    def _run(self, client, run: RunRef):
        return require_run(client, self.experiment_name, run_key(self.pipeline.dag_id, run.run_id, run.clear_number))

    def _champion(self, client):
        """The version holding the champion alias, or None (no registered model, or no champion)."""
        from mlflow.exceptions import MlflowException

        try:
            aliases = client.get_registered_model(self.model_name).aliases or {}
        except MlflowException as e:
            if getattr(e, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        version = aliases.get(self.champion)
        return None if version is None else client.get_model_version(self.model_name, str(version))

    def _versions(self, client):
        """Every registered version of the model, a page at a time (none when it is not registered yet)."""
        token = None
        while True:
            page = client.search_model_versions(f"name='{self.model_name}'", max_results=PAGE_SIZE,
                                                page_token=token)
            yield from page
            token = page.token
            if not token:
                return

    def _published_before(self, client, version: str, partition: str):
        """The version published just before ``partition``: of dataset ``version``, the newest partition
        (tag) before it, the last registered one of that partition; None if there is none. A version
        without the tags (registered by someone else) is not a date's model."""
        from dtrain.pipeline.publish import PARTITION_RE

        best, best_key = None, None
        for found in self._versions(client):
            tags = found.tags or {}
            held = tags.get(PARTITION_TAG)
            if tags.get(DATASET_VERSION_TAG) != version or not isinstance(held, str) or not PARTITION_RE.match(held):
                continue
            key = (held, int(found.version))
            if held < partition and (best_key is None or key > best_key):
                best, best_key = found, key
        return best

    # -- the registry ------------------------------------------------------------------------------

    def baseline(self, version: str, partition: str) -> Baseline | None:
        server = self.server()
        with server.signed_in():
            client = server.client()
            previous = self._published_before(client, version, partition)
            if previous is None:
                return None
            metrics = client.get_run(previous.run_id).data.metrics if previous.run_id else {}
        evaluation = {k[len(EVAL_PREFIX):]: v for k, v in metrics.items() if k.startswith(EVAL_PREFIX)}
        return Baseline(model=f"models:/{self.model_name}/{previous.version}", metrics=evaluation)

    def warm_start(self, version: str, partition: str) -> str:
        """The trained file of the version published just before ``partition``, downloaded once to
        ``<shared_fs>/registry/<dag>/<model>/<version>/``."""
        server = self.server()
        with server.signed_in():
            client = server.client()
            previous = self._published_before(client, version, partition)
            if previous is None or not previous.run_id:
                return ""
            number = check("model version", previous.version, MLFLOW_VERSION, "a model version number")
            name = self.pipeline.model_name
            final = os.path.join(self.pipeline.shared_fs, "registry", self.pipeline.dag_id, self.model_name, number)
            if not os.path.exists(os.path.join(final, name)):
                self._download(client, previous.run_id, f"{TRAINED}/{name}", final)
        return os.path.join(final, name)

    @staticmethod
    def _download(client, run_id: str, artifact: str, final: str) -> None:
        """Into a hidden temporary folder, then renamed: the ranks never see half a model."""
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(final)}.{uuid.uuid4().hex[:8]}.tmp")
        staged = os.path.join(tmp, "version")
        os.makedirs(os.path.join(tmp, "download"))
        os.makedirs(staged)
        try:
            local = client.download_artifacts(run_id, artifact, os.path.join(tmp, "download"))
            os.rename(local, os.path.join(staged, os.path.basename(artifact)))
            os.rename(staged, final)
        except OSError:
            if not os.path.isdir(final):  # another run downloaded the same version first: theirs stays
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def record_evaluation(self, run: RunRef, evaluation: Mapping[str, Any]) -> None:
        """evaluate's metrics, metrics.json and the model (as trained, and as an MLflow Model) into the run."""
        import time

        server = self.server()
        with server.signed_in():
            client = server.client()
            run_id = self._run(client, run).info.run_id
            log_metrics(client, run_id, scalar_series(EVAL_PREFIX, evaluation.get("metrics") or {}),
                        int(time.time() * 1000))
            write_json_artifact(client, run_id, "metrics.json", dict(evaluation))
            model_path = evaluation["model_path"]
            if _no_links(model_path):
                client.log_artifacts(run_id, model_path, f"{TRAINED}/{os.path.basename(model_path)}")
            else:
                client.log_artifact(run_id, model_path, TRAINED)
            if self.load_model:
                self._log_pytorch_model(client, run_id, model_path)

    def _log_pytorch_model(self, client, run_id: str, model_path: str) -> None:
        """The user's module saved in MLflow's PyTorch flavour, uploaded as the run's ``model`` artifact."""
        import tempfile

        import mlflow.pytorch
        import torch

        from dtrain.preprocess.transform import resolve

        module = resolve(self.load_model, field="registry load_model")(model_path)
        code = own_packages(module) if self.code is None else self.code
        with tempfile.TemporaryDirectory(prefix="dtrain-mlflow-model-") as tmp:
            local = os.path.join(tmp, MLFLOW_MODEL)
            # pickle, not MLflow's default pt2 (a traced graph that needs an input example and fixes its
            # shapes); requirements given, not inferred (inference loads the model again in a subprocess).
            # A pickle names the model's classes: their packages' code travels with it (code/), which
            # mlflow.pytorch.load_model puts on sys.path before unpickling.
            mlflow.pytorch.save_model(
                module, local, serialization_format="pickle", code_paths=[_source_of(name) for name in code] or None,
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", *self.requirements],
                metadata={"dtrain.artifacts": {name: f"{ARTIFACTS_DIR}/{name}" for name in self.artifacts}})
            for name, path in self.artifacts.items():
                _copy_artifact(name, _artifact_source(model_path, path), os.path.join(local, ARTIFACTS_DIR, name))
            client.log_artifacts(run_id, local, MLFLOW_MODEL)

    def _source(self, run_id: str) -> str:
        if self.load_model:
            return f"runs:/{run_id}/{MLFLOW_MODEL}"
        return f"runs:/{run_id}/{TRAINED}/{self.pipeline.model_name}"

    def _registered(self, client, run_id: str, run: RunRef):
        """This run's version, registering it only if an earlier try did not (a retry never duplicates)."""
        from mlflow.exceptions import MlflowException

        try:
            client.create_registered_model(self.model_name)
        except MlflowException as e:
            if getattr(e, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise
        mine = client.search_model_versions(f"name='{self.model_name}' and run_id='{run_id}'")
        if mine:
            return max(mine, key=lambda v: int(v.version))
        tags = {PARTITION_TAG: run.partition, DATASET_VERSION_TAG: run.version,
                "dtrain.dag_id": self.pipeline.dag_id, "dtrain.run_id": run.run_id}
        return client.create_model_version(self.model_name, self._source(run_id), run_id=run_id, tags=tags)

    def publish(self, run: RunRef, model_path: str, record: dict[str, Any]) -> Published:
        """Register the run's model, then move champion to it unless that would move it backwards."""
        server = self.server()
        with server.signed_in():
            client = server.client()
            tracked = self._run(client, run)
            run_id = tracked.info.run_id
            write_json_artifact(client, run_id, "metrics.json", record)  # with the gate's and approver's verdicts
            version = self._registered(client, run_id, run)
            champion = self._champion(client)
            held = (champion.tags or {}).get(PARTITION_TAG) if champion is not None else None
            if champion is not None and str(champion.version) == str(version.version):
                alias = self.champion  # a retry after the alias moved
            elif held is not None and held > run.partition:
                alias = self.challenger  # a backfilled date: the champion serves a newer one
            else:
                alias = self.champion
            client.set_registered_model_alias(self.model_name, alias, version.version)
        kept = None if alias == self.champion else f"{self.champion} stays at version {champion.version} ({held})"
        out = {"registry": "mlflow", "model_name": self.model_name, "version": str(version.version), "alias": alias,
               "model_uri": f"models:/{self.model_name}/{version.version}", "mlflow_run_id": run_id,
               "experiment_id": tracked.info.experiment_id, "champion": alias == self.champion}
        summary = f"registered {self.model_name} version {version.version} as @{alias}" + (f"; {kept}" if kept else "")
        return Published(record=out, asset_extra={k: out[k] for k in ("model_uri", "version", "alias")},
                         summary=summary)
