"""Where the operators get SSH hosts: explicit arguments first, else an Airflow SSH connection."""

from __future__ import annotations

from typing import Any


def resolve_hosts(*, backend: Any, ssh_conn_id: str | None, hostfile: str | None, hosts: Any,
                  ssh: dict[str, Any] | None) -> dict[str, Any]:
    """``hostfile``/``hosts``/``ssh`` for the LaunchSpec, non-empty values only.

    The connection is read only for ``backend='ssh'`` and only when no hostfile or hosts were
    given; explicit ``ssh`` settings win over the connection's.
    """
    hosts = hosts or None
    if ssh_conn_id and str(backend).strip().lower() == "ssh" and not (hostfile or hosts):
        from airflow.sdk import BaseHook

        from operators.launch.hostfile import from_airflow_connection

        hosts, conn_ssh = from_airflow_connection(BaseHook.get_connection(ssh_conn_id))
        ssh = {**conn_ssh, **(ssh or {})}
    return {k: v for k, v in (("hostfile", hostfile or None), ("hosts", hosts), ("ssh", ssh)) if v}
