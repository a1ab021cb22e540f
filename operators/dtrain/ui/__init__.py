"""The Airflow UI for training jobs: a Training tab on each task instance and a Retraining page.

Registered by dtrain.plugin: ``external_views`` put the pages in Airflow's UI, ``fastapi_apps``
serves them and their JSON API under ``/dtrain`` (dtrain.ui.app). The app is built on its
first request (:class:`LazyApp`), so loading the plugin (every Airflow process does, the DAG
processor too) imports neither FastAPI routes nor matplotlib.
"""

from __future__ import annotations

import threading

# The Training tab's route and URL, shared with the training operator's "Training" link: the launch
# package holds the link and does not import this package.
from dtrain.launch.airflow.ui_urls import TAB_ROUTE, training_tab_url, ui_base  # noqa: F401 (re-exported)

URL_PREFIX = "/dtrain"
PAGE_ROUTE = "retraining"


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
