"""An Airflow SSH connection as the ssh backend's hosts and settings: where the operators get SSH hosts.

Explicit options come first (``hostfile`` or ``hosts``); only without them is the connection named
by ``conn_id`` read (its host, port, login and extra, as ``from_airflow_connection`` in
dtrain.launch.backends.ssh.hostfile reads them). Airflow is imported inside the function: at
execute time, never at DAG parse.
"""

from __future__ import annotations

from typing import Any, Mapping


def resolve_connection(options: Mapping[str, Any]) -> dict[str, Any]:
    """The ssh backend's options with ``conn_id`` replaced by what the connection gives.

    The connection is read only when no ``hostfile`` or ``hosts`` were given; explicit
    settings win over the connection's.
    """
    options = {k: v for k, v in options.items() if v not in (None, "", [], {})}
    conn_id = options.pop("conn_id", None)
    if not conn_id or "hostfile" in options or "hosts" in options:
        return options
    from airflow.sdk import BaseHook

    from dtrain.launch.backends.ssh.hostfile import from_airflow_connection

    hosts, settings = from_airflow_connection(BaseHook.get_connection(conn_id))
    return {"hosts": hosts, **settings, **options}
