"""The plugin's FastAPI app, mounted by Airflow's API server under ``/dtrain``.

Pages (shown by the Airflow UI in an iframe; see dtrain.plugin):

* ``GET /dtrain/ti?dag_id&run_id&task_id&map_index``: the Training tab of one task instance;
* ``GET /dtrain/retraining``: the Retraining page (every retraining pipeline the user may read).

JSON API (what the pages use; other tools may call it with an Airflow token):

* ``GET /dtrain/api/ti/summary``: the job (backend, shape, state, duration, result), the failing
  rank and its tail, the hang verdict and which stack dumps exist, the stall report, checkpoints,
  an elastic job's rounds (from its result, or the rounds XCom of one that failed; validated:
  dtrain.ui.training.task_rounds), and the folders of the run directory holding more entries than
  are read (``unread``: how many were read, how many more were not);
* ``GET /dtrain/api/ti/curves?since_step=N``: per-rank points of loss, samples/s, data-wait fraction;
* ``GET /dtrain/api/ti/logs?lines=N``: the last lines of each rank's log (and ``unread``, as above);
* ``GET /dtrain/api/ti/stack?rank=R``: a rank's stack dump (text);
* ``GET /dtrain/api/ti/plot/{curve}.svg``: one curve, a line per rank (beyond 16 ranks their envelope:
  lowest, median and highest rank per step), a marker at each round's resume step;
* ``GET /dtrain/api/retraining`` and ``/dtrain/api/retraining/plot.svg?dag_id``.

Every ``ti`` endpoint takes the task instance as query parameters and is guarded by Airflow's own
``requires_access_dag`` (reading that DAG's task instances; logs and stacks need its task logs), so
the deployment's auth manager decides; the retraining endpoints list only the DAGs the auth manager
says the user may read. Files are located from the task instance's recorded XCom, never from the
request, and shown only when their provenance holds (dtrain.ui.provenance: under a configured root or
the runs root the task's own DAG code declares in its serialized DAG, marked by the launcher for
this task instance; otherwise 404 with the reason), read by
dtrain.rundir without following symlinks, bounded. A run's metrics are followed once per run
directory, within bounds (dtrain.ui.metrics_cache). Rank-written numbers that JSON or a plot cannot
carry are dropped there; any non-finite number left in a view is sent as null.
"""

from __future__ import annotations

import math
import re
from html import escape
from importlib import resources
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import SessionDep
from airflow.api_fastapi.core_api.security import GetUserDep, requires_access_dag, requires_authenticated

from dtrain.errors import SpecError
from dtrain.launch.core.job import ROUNDS_KEY, RUN_RECORD_KEY
from dtrain.hooks.mlflow import server_ui_url
from dtrain.mlflow import links as mlflow_links
from dtrain.mlflow.tracking import RUN_XCOM_KEY as MLFLOW_RUN_KEY
from dtrain.ui.provenance import (Untrusted, declared_root, models_roots, runs_roots, trusted_published,
                               trusted_run_dir)
from dtrain.rundir import RunDir, UnsafeRunDir
from dtrain.ui import metrics_cache, plots, retraining, store, training, ui_base

#: what a page may load: its own scripts and styles (matplotlib's SVG uses style attributes), framed
#: only by the Airflow UI of the same origin
CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'self'; base-uri 'none'; form-action 'none'")
MAP_INDEX = re.compile(r"-?\d{1,9}")
MAX_ID = 250  # Airflow's ID_LEN
STATIC = {"training.js": "text/javascript", "retraining.js": "text/javascript", "dtrain.css": "text/css"}

read_ti = Depends(requires_access_dag("GET", DagAccessEntity.TASK_INSTANCE))
read_logs = Depends(requires_access_dag("GET", DagAccessEntity.TASK_LOGS))
read_runs = Depends(requires_access_dag("GET", DagAccessEntity.RUN))
authenticated = Depends(requires_authenticated())


class TaskInstanceRef:
    """The task instance a ``ti`` request is about (query parameters, checked)."""

    def __init__(self, dag_id: Annotated[str, Query(max_length=MAX_ID)], run_id: Annotated[str, Query(max_length=MAX_ID)],
                 task_id: Annotated[str, Query(max_length=MAX_ID)], map_index: Annotated[str, Query(max_length=12)] = "-1"):
        # The UI leaves {MAP_INDEX} in the link of a task that is not mapped.
        if map_index in ("", "{MAP_INDEX}"):
            map_index = "-1"
        if not MAP_INDEX.fullmatch(map_index):
            raise HTTPException(422, f"map_index={map_index!r}: an integer (-1 for a task that is not mapped)")
        for name, value in (("dag_id", dag_id), ("run_id", run_id), ("task_id", task_id)):
            if not value or "\0" in value:
                raise HTTPException(422, f"{name}={value!r}: a non-empty id")
        self.dag_id, self.run_id, self.task_id, self.map_index = dag_id, run_id, task_id, int(map_index)

    def query(self) -> dict[str, Any]:
        return {"dag_id": self.dag_id, "run_id": self.run_id, "task_id": self.task_id, "map_index": self.map_index}


TIRef = Annotated[TaskInstanceRef, Depends()]


def _secure(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-store"
    return response


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float as None: JSON has no inf or NaN (starlette refuses them),
    and a ratio or sum of rank-written numbers can still overflow."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json(data: Any) -> Response:
    return _secure(JSONResponse(_finite(data)))


def _records(session, ref: TaskInstanceRef) -> tuple[dict[str, Any], dict[str, Any]]:
    ti = store.task_instance(session, ref.dag_id, ref.run_id, ref.task_id, ref.map_index)
    if ti is None:
        raise HTTPException(404, f"no task instance {ref.dag_id}/{ref.run_id}/{ref.task_id}[{ref.map_index}]")
    return ti, store.xcoms(session, ref.dag_id, ref.run_id, ref.task_id, ref.map_index,
                           (RUN_RECORD_KEY, "return_value", "hang", MLFLOW_RUN_KEY, ROUNDS_KEY))


def _roots(which) -> list[str]:
    try:
        return which()
    except SpecError as exc:  # the deployment's configuration, not the request
        raise HTTPException(500, str(exc)) from exc


def _run_dir(session, ti: dict[str, Any], records: dict[str, Any]) -> RunDir | None:
    """The run directory the task recorded before it launched (None: it launched no job), if its
    provenance holds (dtrain.ui.provenance: under a configured root or the one the task's DAG code
    declares, and marked); else 404 saying why."""
    record = records.get(RUN_RECORD_KEY)
    if not isinstance(record, dict):
        return None
    declared = declared_root(store.declared_run_dir(session, ti["dag_id"], ti["run_id"], ti["task_id"],
                                                    ti["map_index"]), ti["dag_id"])
    try:
        return trusted_run_dir(record.get("run_dir"), ti, _roots(runs_roots), declared)
    except Untrusted as exc:
        raise HTTPException(404, f"not showing the job of task {ti['task_id']} of {ti['dag_id']}/{ti['run_id']}: "
                                 f"{exc}") from None


def _require_run(session, ref: TaskInstanceRef) -> RunDir:
    return _require(_run_dir(session, *_records(session, ref)), ref)


def _require(run: RunDir | None, ref: TaskInstanceRef) -> RunDir:
    if run is None:
        raise HTTPException(404, f"task {ref.task_id} of {ref.dag_id}/{ref.run_id} recorded no training job")
    return run


def read_published(dag_id: str, metrics_path: Any, partition: Any) -> dict[str, Any] | None:
    """A published model's metrics.json, as the publish task recorded its path, if it is the
    pipeline's record for the run's partition (dtrain.ui.provenance.trusted_published); else None."""
    try:
        return trusted_published(metrics_path, dag_id, partition, _roots(models_roots))
    except Untrusted:
        return None


def _pipeline_view(session, dag_id: str) -> dict[str, Any]:
    return retraining.pipeline_view(dag_id, store.pipeline_runs(session, dag_id),
                                    lambda path, partition: read_published(dag_id, path, partition),
                                    server_ui_url())


def _page(request: Request, name: str, title: str, data: dict[str, str]) -> Response:
    root = request.scope.get("root_path", "")
    attrs = " ".join(f'data-{k}="{escape(v)}"' for k, v in {"root": root, **data}.items())
    body = resources.files("dtrain.ui").joinpath("static", name).read_text(encoding="utf-8")
    html = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<link rel="stylesheet" href="{escape(root)}/static/dtrain.css"></head>'
            f'<body {attrs}>{body}<script src="{escape(root)}/static/{name.replace(".html", ".js")}"></script>'
            "</body></html>")
    return _secure(HTMLResponse(html))


def _refused(request: Request, exc: UnsafeRunDir) -> Response:
    """A run directory made a link after its provenance check (a rank may rename its own): refused."""
    return _secure(JSONResponse({"detail": f"not showing the job: {exc}"}, status_code=404))


def create_app() -> FastAPI:
    app = FastAPI(title="dtrain", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(UnsafeRunDir, _refused)

    @app.get("/ti", dependencies=[read_ti])
    def training_tab(request: Request, ref: TIRef) -> Response:
        return _page(request, "training.html", f"Training: {ref.dag_id} / {ref.task_id}",
                     {k: str(v) for k, v in ref.query().items()} | {"ui": ui_base()})

    @app.get("/retraining", dependencies=[authenticated])
    def retraining_page(request: Request) -> Response:
        return _page(request, "retraining.html", "Retraining", {"ui": ui_base()})

    @app.get("/static/{name}", dependencies=[authenticated])
    def static(name: str) -> Response:
        if name not in STATIC:
            raise HTTPException(404, "no such file")
        body = resources.files("dtrain.ui").joinpath("static", name).read_bytes()
        return _secure(Response(body, media_type=STATIC[name]))

    @app.get("/api/ti/summary", dependencies=[read_ti])
    def ti_summary(session: SessionDep, ref: TIRef) -> Response:
        ti, records = _records(session, ref)
        result = records.get("return_value") if isinstance(records.get("return_value"), dict) else None
        hang = records.get("hang") if isinstance(records.get("hang"), dict) else None
        run = _run_dir(session, ti, records)
        metrics = metrics_cache.follow(run).records if run else None
        view = training.job_view(ti=ti, record=records.get(RUN_RECORD_KEY) if run else None,
                                 result=result, hang=hang, run=run, metrics=metrics, rounds=records.get(ROUNDS_KEY))
        if MLFLOW_RUN_KEY in records:
            view["mlflow_run"] = mlflow_links.run_link(server_ui_url(), records[MLFLOW_RUN_KEY])
        return _json(view)

    @app.get("/api/ti/curves", dependencies=[read_ti])
    def ti_curves(session: SessionDep, ref: TIRef, since_step: Annotated[int, Query(ge=-1)] = -1) -> Response:
        live = metrics_cache.follow(_require_run(session, ref))
        curves = live.once("curves", training.curves) if since_step < 0 else training.curves(live.records, since_step)
        return _json({"curves": curves})

    @app.get("/api/ti/plot/{curve}.svg", dependencies=[read_ti])
    def ti_plot(session: SessionDep, ref: TIRef, curve: str) -> Response:
        if curve not in training.CURVES:
            raise HTTPException(404, f"curve={curve!r}: one of {', '.join(training.CURVES)}")
        ti, records = _records(session, ref)
        live = metrics_cache.follow(_require(_run_dir(session, ti, records), ref))
        title, ylabel = training.CURVES[curve]
        # An elastic job's rounds come with its result (none while it runs): the plot is drawn again when
        # they change, and one plot a curve is kept (an XCom edited again and again keeps no more).
        marks = training.round_marks(training.task_rounds(records.get("return_value"), records.get(ROUNDS_KEY)))
        kept = live.once(("plot", curve), lambda _: {})
        with live.lock:
            if kept.get("marks") != marks:
                kept.update(marks=marks, svg=plots.rank_curves(
                    curve, title, ylabel, training.plot_points(live.once("curves", training.curves)[curve]), marks))
            svg = kept["svg"]
        return _secure(Response(svg, media_type="image/svg+xml"))

    @app.get("/api/ti/logs", dependencies=[read_logs])
    def ti_logs(session: SessionDep, ref: TIRef, lines: Annotated[int, Query(ge=1, le=200)] = training.TAIL_LINES) -> Response:
        run = _require_run(session, ref)
        tails = {str(rank): tail for rank, tail in run.log_tails(lines).items()}
        return _json({"tails": tails, "unread": training.unread_view(run.unread)})

    @app.get("/api/ti/stack", dependencies=[read_logs])
    def ti_stack(session: SessionDep, ref: TIRef, rank: Annotated[int, Query(ge=0, le=1_000_000)]) -> Response:
        text = _require_run(session, ref).stack(rank)
        if text is None:
            raise HTTPException(404, f"no stack dump of rank {rank}")
        return _secure(PlainTextResponse(text))

    @app.get("/api/retraining")
    def retraining_api(session: SessionDep, user: GetUserDep) -> Response:
        from airflow.api_fastapi.app import get_auth_manager

        readable = get_auth_manager().get_authorized_dag_ids(user=user, method="GET", session=session)
        return _json({"pipelines": [_pipeline_view(session, dag_id)
                                    for dag_id in store.retraining_dag_ids(session, readable)]})

    @app.get("/api/retraining/plot.svg", dependencies=[read_runs])
    def retraining_plot(session: SessionDep, dag_id: Annotated[str, Query(max_length=MAX_ID)]) -> Response:
        view = _pipeline_view(session, dag_id)
        svg = plots.partition_metric(dag_id, view["metric"] or "metric", view["points"])
        return _secure(Response(svg, media_type="image/svg+xml"))

    return app
