"""Where Airflow's UI shows a task instance's Training tab: the route the plugin registers the tab
under (:func:`dtrain.ui.external_views`) and the URL the operator's "Training" link opens
(:class:`~dtrain.launch.airflow.links.TrainingLink`).

Here rather than in dtrain.ui because the link belongs to the operator and the launch package does
not import the UI; dtrain.ui imports these names from here. Stdlib only at import (dtrain.ui's
pure modules must not pull in Airflow, whose SDK takes seconds to import): Airflow's configuration
is read when :func:`ui_base` runs.
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit

TAB_ROUTE = "training"


def ui_base() -> str:
    """The path Airflow's UI and API are served under (``[api] base_url``; '' at the root)."""
    from airflow.configuration import conf

    return urlsplit(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")


def training_tab_url(dag_id: str, run_id: str, task_id: str, map_index: int = -1, base: str | None = None) -> str:
    """The Airflow UI's URL of a task instance's Training tab (path only, under ``[api] base_url``)."""
    base = ui_base() if base is None else base
    ti = f"{base}/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}/tasks/{quote(task_id, safe='')}"
    if map_index is not None and int(map_index) >= 0:
        ti += f"/mapped/{int(map_index)}"
    return f"{ti}/plugin/{TAB_ROUTE}"
