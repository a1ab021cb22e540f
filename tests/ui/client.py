"""Requests to Airflow's real API server app (tests/ui/conftest.py's ``api``) as a given user: dtrain's
pages and JSON API, and Airflow's own REST API (what any user with the right grants can call)."""

from __future__ import annotations

from urllib.parse import quote


def ti_query(run, map_index="{MAP_INDEX}", dag_id="ui_training", task_id="train") -> dict:
    # The UI leaves {MAP_INDEX} in the link of a task that is not mapped: the API takes it as -1.
    return {"dag_id": dag_id, "run_id": run if isinstance(run, str) else run.run_id, "task_id": task_id,
            "map_index": map_index}


def get(api, path, params=None, user=("admin", "admin")):
    headers = {"Authorization": f"Bearer {api.token(*user)}"} if user else {}
    return api.get(path, params=params, headers=headers)


def rest(api, method: str, path: str, body=None, user=("admin", "admin")):
    """Airflow's public REST API (``/api/v2``), as ``user``."""
    return api.request(method, "/api/v2" + path, json=body, headers={"Authorization": f"Bearer {api.token(*user)}"})


def xcom_entries(dag_id: str, run_id: str, task_id: str, key: str = "") -> str:
    path = f"/dags/{quote(dag_id, safe='')}/dagRuns/{quote(run_id, safe='')}/taskInstances/{quote(task_id, safe='')}" \
           "/xcomEntries"
    return path + (f"/{quote(key, safe='')}" if key else "")
