"""dtrain.hooks.ssh: an Airflow SSH connection (given as AIRFLOW_CONN_<ID>), read for the ssh backend,
which turns it into hosts and settings (dtrain.launch.backends.ssh.connection)."""

from __future__ import annotations

import json

import pytest

from dtrain.hooks.ssh import ssh_connection
from dtrain.launch.backends.ssh.connection import resolve_connection


@pytest.fixture
def gpu_hosts(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_DTRAIN_GPU_HOSTS", json.dumps({
        "conn_type": "ssh", "host": "gpu-a, gpu-b", "login": "trainer", "port": 2222,
        "extra": {"key_file": "/etc/dtrain/id_ed25519", "no_host_key_check": "true"}}))
    return "dtrain_gpu_hosts"


def test_the_hook_reads_the_connection(gpu_hosts):
    conn = ssh_connection(gpu_hosts)
    assert (conn.host, conn.login, conn.port) == ("gpu-a, gpu-b", "trainer", 2222)


def test_the_connection_gives_hosts_and_settings(gpu_hosts):
    assert resolve_connection({"conn_id": gpu_hosts, "python": "/opt/venv/bin/python"}) == {
        "hosts": ["gpu-a", "gpu-b"], "user": "trainer", "port": 2222, "key_file": "/etc/dtrain/id_ed25519",
        "strict_host_key_checking": "no", "python": "/opt/venv/bin/python"}


def test_explicit_hosts_win_and_the_connection_is_not_read(monkeypatch):
    # No such connection exists: reading it would fail, so passing proves it was not read.
    monkeypatch.delenv("AIRFLOW_CONN_DTRAIN_NO_SUCH_HOSTS", raising=False)
    assert resolve_connection({"conn_id": "dtrain_no_such_hosts", "hosts": ["h1"], "user": None}) == {"hosts": ["h1"]}
    with pytest.raises(Exception):
        resolve_connection({"conn_id": "dtrain_no_such_hosts"})


def test_the_ssh_backend_reads_its_connection_through_the_hook(gpu_hosts):
    from dtrain.launch.backends import get_backend_class

    resolved = get_backend_class("ssh").resolve_operator_options({"conn_id": gpu_hosts, "user": "override"})
    assert resolved["hosts"] == ["gpu-a", "gpu-b"] and resolved["user"] == "override"
