"""The Airflow UI for training jobs: a Training tab on each task instance and a Retraining page.

Registered by dtrain.plugin: ``external_views`` put the pages in Airflow's UI, ``fastapi_apps``
serves them and their JSON API under ``/dtrain`` (dtrain.ui.app). The app is built on its
first request (:class:`LazyApp`), so loading the plugin (every Airflow process does, the DAG
processor too) imports neither FastAPI routes nor matplotlib.
"""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

URL_PREFIX = "/dtrain"
TAB_ROUTE = "training"
PAGE_ROUTE = "retraining"


def ui_base() -> str:
    """The path Airflow's UI and API are served under (``[api] base_url``; '' at the root)."""
    from airflow.configuration import conf

    return urlsplit(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")


def training_tab_url(dag_id: str, run_id: str, task_id: str, map_index: int = -1, base: str | None = None) -> str:
    """The Airflow UI's URL of a task instance's Training tab (path only, under ``[api] base_url``)."""
    from urllib.parse import quote

    base = ui_base() if base is None else base
    ti = f"{base}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}/tasks/{quote(task_id, safe='')}"
    if map_index is not None and int(map_index) >= 0:
        ti += f"/mapped/{int(map_index)}"
    return f"{ti}/plugin/{TAB_ROUTE}"


class LazyApp:
    """An ASGI app that builds the real one (dtrain.ui.app.create_app) on its first request."""

    def __init__(self) -> None:
        self._app = None
        self._lock = threading.Lock()

    def app(self):
        with self._lock:
            if self._app is None:
                from dtrain.ui.app import create_app

                self._app = create_app()
        return self._app

    async def __call__(self, scope, receive, send) -> None:
        await self.app()(scope, receive, send)


def external_views(base: str) -> list[dict]:
    """The UI entries: the Training tab of every task instance, and the Retraining page in the nav."""
    prefix = base + URL_PREFIX
    return [
        {"name": "Training", "destination": "task_instance", "url_route": TAB_ROUTE,
         "href": prefix + "/ti?dag_id={DAG_ID}&run_id={RUN_ID}&task_id={TASK_ID}&map_index={MAP_INDEX}"},
        {"name": "Retraining", "destination": "nav", "url_route": PAGE_ROUTE, "href": prefix + "/retraining",
         "category": "browse"},
    ]
