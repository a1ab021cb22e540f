"""An Airflow SSH connection, read at execute time: where the operators' SSH hosts come from.

The ssh backend turns it into hosts and settings (dtrain.launch.backends.ssh.connection, with
``from_airflow_connection`` in dtrain.launch.backends.ssh.hostfile reading its host, port, login
and extra). Airflow is imported inside the function, never at DAG parse.
"""

from __future__ import annotations

from typing import Any


def ssh_connection(conn_id: str) -> Any:
    """Airflow connection ``conn_id`` (Airflow's not-found error when there is none)."""
    from airflow.sdk import BaseHook

    return BaseHook.get_connection(conn_id)
