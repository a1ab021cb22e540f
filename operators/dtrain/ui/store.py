"""What the pages read from Airflow's metadata database: task instances, DAG runs and XComs.

Every location the API opens comes from here, from a task instance's recorded XCom: the
training task's run record (dtrain.launch.core.job.RUN_RECORD_KEY) and the publish task's result.
Read-only queries through the API server's own session.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections import OrderedDict
from typing import Any, Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from dtrain.launch.core.job import RUN_RECORD_KEY
from dtrain.pipeline.config import partition_of
from dtrain.pipeline.task_ids import DECISION_KEY, EVALUATE, GATE, LIST_RAW_INPUTS, PUBLISH

#: the tag the pipeline factory gives every retraining DAG (dtrain.pipeline.factory)
RETRAINING_TAG = "retraining"
#: runs of one pipeline shown on the Retraining page, newest first
MAX_RUNS = 200
#: DAG versions whose tasks' declared run directories are kept (a version's serialized DAG does not
#: change once a task instance ran with it)
MAX_DAG_VERSIONS = 64

_RUN_DIRS: OrderedDict[Any, dict[str, Any]] = OrderedDict()
_RUN_DIRS_LOCK = threading.Lock()


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value else None


def task_instance(session: Session, dag_id: str, run_id: str, task_id: str, map_index: int) -> dict[str, Any] | None:
    from airflow.models.taskinstance import TaskInstance

    ti = session.scalar(select(TaskInstance).where(
        TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id, TaskInstance.task_id == task_id,
        TaskInstance.map_index == map_index))
    if ti is None:
        return None
    duration = ti.duration
    if duration is None and ti.start_date is not None:
        duration = (dt.datetime.now(dt.timezone.utc) - ti.start_date).total_seconds()
    return {"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "map_index": map_index,
            "state": str(ti.state.value if hasattr(ti.state, "value") else ti.state) if ti.state else None,
            "try_number": ti.try_number, "start_date": _iso(ti.start_date), "end_date": _iso(ti.end_date),
            "duration_s": round(duration, 1) if duration is not None else None}


def declared_run_dir(session: Session, dag_id: str, run_id: str, task_id: str, map_index: int) -> Any:
    """The ``run_dir`` the task's DAG code gives it, unrendered (dtrain.ui.provenance.declared_root reads
    its root), from the serialized DAG of the version this task instance belongs to: what the DAG
    processor wrote from the DAG file, never an XCom. None: the code gives none."""
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.models.taskinstance import TaskInstance

    version = session.scalar(select(TaskInstance.dag_version_id).where(
        TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id, TaskInstance.task_id == task_id,
        TaskInstance.map_index == map_index))
    if version is None:
        return None
    with _RUN_DIRS_LOCK:
        run_dirs = _RUN_DIRS.get(version)
    if run_dirs is None:
        row = session.scalar(select(SerializedDagModel).where(SerializedDagModel.dag_version_id == version))
        run_dirs = _task_run_dirs(row.data if row is not None else None)
        with _RUN_DIRS_LOCK:
            _RUN_DIRS[version] = run_dirs
            while len(_RUN_DIRS) > MAX_DAG_VERSIONS:
                _RUN_DIRS.popitem(last=False)
    return run_dirs.get(task_id)


def _task_run_dirs(data: Any) -> dict[str, Any]:
    """task id -> its ``run_dir`` field, of every task of a serialized DAG that has one."""
    tasks = data.get("dag", {}).get("tasks", []) if isinstance(data, dict) else []
    fields = (task.get("__var") for task in tasks if isinstance(task, dict))
    return {f["task_id"]: f["run_dir"] for f in fields if isinstance(f, dict) and "run_dir" in f and "task_id" in f}


def xcoms(session: Session, dag_id: str, run_id: str, task_id: str, map_index: int,
          keys: Iterable[str]) -> dict[str, Any]:
    """The task instance's XComs under ``keys`` (absent keys left out)."""
    from airflow.models.xcom import XComModel

    rows = session.execute(select(XComModel.key, XComModel.value).where(
        XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.task_id == task_id,
        XComModel.map_index == map_index, XComModel.key.in_(list(keys)))).all()
    return {row.key: XComModel.deserialize_value(row) for row in rows}


def retraining_dag_ids(session: Session, readable: set[str]) -> list[str]:
    """Retraining pipelines (tagged by the factory) that the user may read, by name."""
    from airflow.models.dag import DagModel, DagTag

    rows = session.scalars(select(DagTag.dag_id).join(DagModel, DagModel.dag_id == DagTag.dag_id).where(
        DagTag.name == RETRAINING_TAG, DagModel.is_stale.is_(False))).all()
    return sorted(set(rows) & readable)


def pipeline_runs(session: Session, dag_id: str) -> list[dict[str, Any]]:
    """The pipeline's runs, newest first, each with its gate decision, evaluation, publish result,
    the tasks that recorded a training job (their Training tabs), and whether it was skipped for
    lack of data (``no_data``: its raw-input listing found no file and skipped the run)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.state import TaskInstanceState

    runs = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id)
                           .order_by(DagRun.run_after.desc()).limit(MAX_RUNS)).all()
    if not runs:
        return []
    wanted = (((GATE, DECISION_KEY), "decision"), ((EVALUATE, "return_value"), "evaluation"),
              ((PUBLISH, "return_value"), "published"))
    rows = session.execute(select(XComModel.run_id, XComModel.task_id, XComModel.map_index, XComModel.key,
                                  XComModel.value).where(
        XComModel.dag_id == dag_id, XComModel.run_id.in_([r.run_id for r in runs]),
        XComModel.key.in_([DECISION_KEY, "return_value", RUN_RECORD_KEY]))).all()
    no_data = set(session.scalars(select(TaskInstance.run_id).where(
        TaskInstance.dag_id == dag_id, TaskInstance.run_id.in_([r.run_id for r in runs]),
        TaskInstance.task_id == LIST_RAW_INPUTS, TaskInstance.state == TaskInstanceState.SKIPPED)).all())
    found: dict[str, dict[str, Any]] = {r.run_id: {"training_tasks": [], "no_data": r.run_id in no_data} for r in runs}
    for row in rows:
        entry = found[row.run_id]
        if row.key == RUN_RECORD_KEY:
            entry["training_tasks"].append({"task_id": row.task_id, "map_index": row.map_index})
            continue
        for (task_id, key), name in wanted:
            if row.task_id == task_id and row.key == key:
                entry[name] = XComModel.deserialize_value(row)
    out = []
    for run in runs:
        out.append({"run_id": run.run_id, "state": str(run.state.value if hasattr(run.state, "value") else run.state),
                    "run_type": str(run.run_type.value if hasattr(run.run_type, "value") else run.run_type),
                    "partition": partition_of(run), "run_after": _iso(run.run_after),
                    "conf": run.conf or {}, **found[run.run_id]})
    return out
