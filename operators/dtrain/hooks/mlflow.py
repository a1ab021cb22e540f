"""The MLflow tracking server's connection: where the server is and how to sign in.

An Airflow connection (type http or https, default ``mlflow_default``) names the server; this
module is the only place the product reads it. A task reads it on the worker through the Task
SDK (:func:`tracking_server`); the API server, which has no Task SDK context, reads the
deployment's connection from its secrets backends (:func:`server_ui_url`) for the UI's links. Airflow
and MLflow are imported inside the functions: never on the DAG-parse path.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from dtrain.environ import temporarily
from dtrain.grammar import MLFLOW_URI, check

#: the variable naming the connection the API server reads the tracking server's address from
CONN_ENV = "DTRAIN_MLFLOW_CONN_ID"
DEFAULT_CONN_ID = "mlflow_default"


@dataclass(frozen=True)
class TrackingServer:
    """Where the tracking server is and how to sign in; credentials never leave the worker."""

    uri: str
    ui_url: str
    credentials: Mapping[str, str] = field(default_factory=dict, repr=False)

    def signed_in(self) -> contextlib.AbstractContextManager:
        """MLflow's REST client reads its credentials from these variables at each request."""
        return temporarily(self.credentials)

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    def run_url(self, experiment_id: str, run_id: str) -> str:
        return f"{self.ui_url}/#/experiments/{experiment_id}/runs/{run_id}"


def tracking_uri(value: Any, field_name: str) -> str:
    """An http(s) URL of a tracking server, without a trailing slash."""
    return check(field_name, value, MLFLOW_URI, "an http:// or https:// URL of an MLflow tracking server, "
                                                "e.g. http://mlflow.internal:5000").rstrip("/")


def server_from_connection(conn) -> TrackingServer:
    """A :class:`TrackingServer` from an Airflow connection (type http or https).

    host, port and schema (a path prefix) give the URL, the connection type its scheme; or the
    extra ``tracking_uri`` gives it whole. login/password (or the extra ``token``) sign in. The extra
    ``ui_url`` is where people open the server's UI, when it differs (a proxy)."""
    extra = conn.extra_dejson if isinstance(getattr(conn, "extra_dejson", None), Mapping) else {}
    field_name = f"connection {conn.conn_id}"
    if extra.get("tracking_uri"):
        uri = tracking_uri(extra["tracking_uri"], f"{field_name} extra tracking_uri")
    else:
        scheme = "https" if (conn.conn_type or "").lower() == "https" else "http"
        port = f":{conn.port}" if conn.port else ""
        path = f"/{conn.schema.strip('/')}" if conn.schema else ""
        uri = tracking_uri(f"{scheme}://{conn.host}{port}{path}", f"{field_name} (host, port, schema)")
    ui_url = tracking_uri(extra["ui_url"], f"{field_name} extra ui_url") if extra.get("ui_url") else uri
    credentials = {}
    if conn.login:
        credentials = {"MLFLOW_TRACKING_USERNAME": conn.login, "MLFLOW_TRACKING_PASSWORD": conn.password or ""}
    elif extra.get("token"):
        credentials = {"MLFLOW_TRACKING_TOKEN": str(extra["token"])}
    return TrackingServer(uri=uri, ui_url=ui_url, credentials=credentials)


def tracking_server(conn_id: str) -> TrackingServer:
    """The server of Airflow connection ``conn_id``, read on the worker (a task's context)."""
    from airflow.sdk import BaseHook

    return server_from_connection(BaseHook.get_connection(conn_id))


def server_ui_url() -> str | None:
    """The tracking server's UI address from the deployment's connection (``DTRAIN_MLFLOW_CONN_ID``,
    default ``mlflow_default``), read on the API server; None when there is none."""
    try:
        from airflow.models.connection import Connection

        conn = Connection.get_connection_from_secrets(os.environ.get(CONN_ENV) or DEFAULT_CONN_ID)
        return server_from_connection(conn).ui_url
    except Exception:  # no such connection (AirflowNotFoundException), or no tracking server's URL (SpecError)
        return None
