"""Which run directory, and which published model record, a task instance's pages may show.

XCom values are not provenance: anyone who may edit a DAG's task instances may PATCH its XComs
through Airflow's REST API (``.../xcomEntries/dtrain_run``), and so point DAG A's Training tab at
DAG B's run directory, or A's Retraining rows at B's published record, showing B's logs, stacks
and metrics to a user who may not read B. So the UI shows a run directory only when

* its path lies under a configured runs root as ``<root>/<dag_id>/...`` (the layout of the
  operator's default ``<DTRAIN_HOME>/runs/<dag_id>/<run_id>/<task_id>`` and of the pipeline
  factory's ``<shared_fs>/runs/<dag_id>/<version>/<partition>/run-<n>``: :mod:`dtrain.paths`), every component from the
  root down opened without following a link (:class:`~dtrain.rundir.RunDir` ``below=``);
* it holds the marker (:data:`dtrain.rundir.MARKER`) the training operator wrote with
  :func:`dtrain.rundir.write_marker` before the job started, naming this DAG, run, task, map index and the
  directory itself, and a try no later than the task instance's (:func:`marker_problem` says why);

and a published record only when its path is ``<models root>/<dag_id>/<version>/<partition>/metrics.json``
under a configured models root and its content names the same pipeline, version and partition,
the partition being the run's (:func:`trusted_published`).

The roots: Airflow options ``[dtrain] runs_root`` and ``[dtrain] models_root`` (environment
``AIRFLOW__DTRAIN__RUNS_ROOT``...), each one or more absolute paths separated by ``:``. Defaults:
where the product writes, ``$DTRAIN_HOME/runs`` and ``$DTRAIN_SHARED_FS/runs`` (the pipeline
factory's runs on the shared filesystem), and ``$DTRAIN_MODELS`` (default
``$DTRAIN_SHARED_FS/models``); the API server must see the same values as the workers.

A DAG's own code counts too, where XCom does not: the runs root its training task's ``run_dir``
names in the DAG file (:func:`declared_root`; the pipeline factory's ``<shared_fs>/runs/<dag_id>/...``),
read from the serialized DAG in the metadata database (the DAG processor wrote it from the DAG
file; no REST call changes it), is a runs root for that task's run directories. So a pipeline
built with ``shared_fs="/fsx"`` is shown whatever the API server's ``DTRAIN_SHARED_FS``; the marker
is checked all the same.

The UI's side: the marker's writer is :mod:`dtrain.rundir`'s, beside the run directory's other files.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping, Sequence

from dtrain.errors import SpecError
from dtrain.paths import dtrain_home, runs_root
from dtrain.pipeline.publish import MAX_METRICS_BYTES, METRICS_FILE
from dtrain.rundir import MARKER, MAX_LISTED, RunDir, UnsafeRunDir

RUNS_ROOT = ("dtrain", "runs_root")
MODELS_ROOT = ("dtrain", "models_root")
#: what a marker names, besides the directory itself (``run_dir``)


class Untrusted(Exception):
    """A recorded location the UI will not show; the message says why (the API answers 404 with it)."""


# -- the roots -------------------------------------------------------------------------------------

def _default_runs_root() -> str:
    from dtrain.pipeline.config import load_config

    return os.pathsep.join(os.path.abspath(runs_root(base)) for base in (dtrain_home(), load_config().shared_fs))


def _default_models_root() -> str:
    from dtrain.pipeline.config import load_config

    return os.path.abspath(load_config().models_root)


def _roots(option: tuple[str, str], default) -> list[str]:
    from airflow.configuration import conf

    value = conf.get(*option, fallback="") or default()
    roots = value.split(os.pathsep)
    for root in roots:
        if not root or not os.path.isabs(root) or os.path.normpath(root) != root:
            raise SpecError(f"[{option[0]}] {option[1]}", value,
                            f"absolute, normalized paths separated by {os.pathsep!r}")
    return roots


def runs_roots() -> list[str]:
    """The configured runs roots (``[dtrain] runs_root``), checked."""
    return _roots(RUNS_ROOT, _default_runs_root)


def models_roots() -> list[str]:
    """The configured models roots (``[dtrain] models_root``), checked."""
    return _roots(MODELS_ROOT, _default_models_root)


#: where a Jinja expression, statement or comment starts in a template
_JINJA = re.compile(r"\{[{%#]")


def declared_root(run_dir: Any, dag_id: str) -> str | None:
    """The runs root a DAG's code names for its training task: the start of the task's ``run_dir`` as
    the DAG file gives it (unrendered), up to the DAG's own folder. The factory's
    ``/fsx/runs/<dag_id>/{{ ... }}/...`` declares ``/fsx/runs``. None: it declares none (no
    ``run_dir``, or the DAG's folder is not written out before the first Jinja expression)."""
    if not isinstance(run_dir, str):
        return None
    found = _JINJA.search(run_dir)
    static = run_dir[:found.start()] if found else run_dir + "/"
    cut = static.rfind(f"/{dag_id}/")
    root = static[:cut] if cut > 0 else ""
    return root if os.path.isabs(root) and os.path.normpath(root) == root and "\0" not in root else None


def _below(path: Any, roots: Sequence[str], what: str, option: tuple[str, str],
           declared: str | None = None) -> tuple[str, list[str]]:
    """The most specific root ``path`` lies strictly under (the configured ``roots``, and the one its
    DAG's code declares), and the components below it."""
    candidates = [*roots, *([declared] if declared else [])]
    inside = [root for root in candidates if isinstance(path, str) and os.path.isabs(path)
              and os.path.normpath(path) == path and path != root and os.path.commonpath([root, path]) == root]
    if not inside:
        raise Untrusted(f"{what}={_short(path)} is not under the configured root "
                        f"({os.pathsep.join(roots)}; [{option[0]}] {option[1]})"
                        + (f" nor under the root its DAG's code declares ({declared})" if declared else ""))
    root = max(inside, key=len)
    return root, os.path.relpath(path, root).split(os.sep)


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# -- the run directory's marker (written by the training operator: dtrain.rundir.write_marker) -----

def marker_problem(marker: Any, ti: Mapping[str, Any], run_dir: str) -> str | None:
    """Why ``marker`` does not vouch for ``run_dir`` as ``ti``'s job (None: it does).

    The try: a retry runs in the same directory (it resumes from its checkpoints) and rewrites the
    marker when it starts, so until then the marker names an earlier try of this same task
    instance: the same job's files, under the same DAG's permissions, and shown. A try later than
    the task instance's own was written by nobody the task instance knows: refused."""
    if not isinstance(marker, dict):
        return f"no launcher's marker ({MARKER}) in it: not a directory this task launched a job in"
    expected = {"dag_id": ti["dag_id"], "run_id": ti["run_id"], "task_id": ti["task_id"],
                "map_index": ti["map_index"], "run_dir": run_dir}
    for key, want in expected.items():
        if marker.get(key) != want or type(marker.get(key)) is not type(want):
            return f"its marker names {key}={_short(marker.get(key))}, not {want!r}"
    tried, current = marker.get("try_number"), ti.get("try_number")
    if type(tried) is not int or tried < 1 or not isinstance(current, int) or tried > current:
        return f"its marker names try {_short(tried)}, not a try up to this task instance's ({current!r})"
    return None


def trusted_run_dir(run_dir: Any, ti: Mapping[str, Any], roots: Sequence[str], declared: str | None = None) -> RunDir:
    """``run_dir`` to read, if it is ``ti``'s (see the module docstring); else :class:`Untrusted`.
    ``declared``: the runs root ``ti``'s DAG code declares (:func:`declared_root`), if any."""
    root, parts = _below(run_dir, roots, "run_dir", RUNS_ROOT, declared)
    if parts[0] != ti["dag_id"]:
        raise Untrusted(f"run_dir={_short(run_dir)} is not in DAG {ti['dag_id']!r}'s folder of the runs root "
                        f"({os.path.join(root, ti['dag_id'])})")
    try:
        run = RunDir(run_dir, below=root, max_listed=MAX_LISTED)  # shown every 2 s: bounded listings
        problem = marker_problem(run.read_json(MARKER), ti, run_dir)
    except UnsafeRunDir as exc:  # a NUL in the path, a link on the way
        problem = str(exc)
    if problem:
        raise Untrusted(f"run_dir={_short(run_dir)}: {problem}")
    return run


# -- a published model's record --------------------------------------------------------------------

def trusted_published(metrics_path: Any, dag_id: str, partition: Any, roots: Sequence[str]) -> dict[str, Any]:
    """The published record (dtrain.pipeline.publish) at ``metrics_path``, if it is ``dag_id``'s for
    ``partition``: the path is ``<models root>/<dag_id>/<version>/<partition>/metrics.json`` and the
    record names that pipeline, version and partition. Else :class:`Untrusted`."""
    root, parts = _below(metrics_path, roots, "metrics_path", MODELS_ROOT)
    if len(parts) != 4 or parts[0] != dag_id or parts[2] != partition or parts[3] != METRICS_FILE:
        raise Untrusted(f"metrics_path={_short(metrics_path)} is not "
                        f"{os.path.join(root, dag_id, '<version>', str(partition), METRICS_FILE)}")
    try:
        raw = RunDir(os.path.dirname(metrics_path), below=root).read(METRICS_FILE, limit=MAX_METRICS_BYTES)
        record = json.loads(raw) if raw is not None else None
    except (UnsafeRunDir, ValueError):
        record = None
    if not isinstance(record, dict):
        raise Untrusted(f"metrics_path={_short(metrics_path)}: not a readable record (a regular file, "
                        f"at most {MAX_METRICS_BYTES} bytes of JSON)")
    named = (record.get("pipeline"), record.get("dataset_version"), record.get("partition"))
    if named != (dag_id, parts[1], partition):
        raise Untrusted(f"metrics_path={_short(metrics_path)}: its record names {_short(named)}, "
                        f"not {(dag_id, parts[1], partition)!r}")
    return record
