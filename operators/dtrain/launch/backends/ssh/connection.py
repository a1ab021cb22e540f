"""Where the operators get SSH hosts: explicit options first, else an Airflow SSH connection."""

from __future__ import annotations

from typing import Any, Mapping


def resolve_connection(options: Mapping[str, Any]) -> dict[str, Any]:
    """The ssh backend's options with ``conn_id`` replaced by what the connection gives.

    The connection is read (dtrain.hooks.ssh, at execute time) only when no ``hostfile`` or
    ``hosts`` were given; explicit settings win over the connection's.
    """
    options = {k: v for k, v in options.items() if v not in (None, "", [], {})}
    conn_id = options.pop("conn_id", None)
    if not conn_id or "hostfile" in options or "hosts" in options:
        return options
    from dtrain.hooks.ssh import ssh_connection
    from dtrain.launch.backends.ssh.hostfile import from_airflow_connection

    hosts, settings = from_airflow_connection(ssh_connection(conn_id))
    return {"hosts": hosts, **settings, **options}
