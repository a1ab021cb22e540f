"""Hostfile parsing (DeepSpeed's lines, user@host:port), SSH settings and the spec's checks:
every mistake is a SpecError naming where it is and what is allowed, before anything starts."""

from __future__ import annotations

import os

import pytest

from dtrain.errors import SpecError
from dtrain.launch.backends.ssh.hostfile import (HostEntry, SSHSettings, coerce_hosts, from_airflow_connection,
                                       parse_hostfile_text, read_hostfile)
from dtrain.launch.core.spec import LaunchSpec


def test_deepspeed_lines_and_the_user_port_extension():
    text = """
# DeepSpeed's format, unchanged
worker-1 slots=4
worker-2 slots=4   # trailing comment
alice@10.0.0.3:2222 slots=8
bob@[fd00::3]:22 slots=1
gpu-node.example.org
"""
    assert parse_hostfile_text(text) == [
        HostEntry("worker-1", 4, None, None, 3),
        HostEntry("worker-2", 4, None, None, 4),
        HostEntry("10.0.0.3", 8, "alice", 2222, 5),
        HostEntry("[fd00::3]", 1, "bob", 22, 6),
        HostEntry("gpu-node.example.org", None, None, None, 7),
    ]
    assert parse_hostfile_text("bob@[fd00::3]:22 slots=1")[0].address == "fd00::3"
    assert str(parse_hostfile_text("alice@w:2222 slots=2")[0]) == "alice@w:2222 slots=2"


@pytest.mark.parametrize("text, field, value, allowed", [
    ("w1 slots=4\nw2 slots=four", "hostfile line 2", "four", "positive integer"),
    ("w1 slots=0", "hostfile line 1", "0", "positive integer"),
    ("w1 slot=4", "hostfile line 1", "slot=4", "only 'slots=N'"),
    ("w1 slots=2 slots=3", "hostfile line 1", "slots=3", "slots given once"),
    ("-oProxyCommand=touch slots=1", "hostfile line 1", "-oProxyCommand=touch", "[user@]host[:port]"),
    ("w1:99999 slots=1", "hostfile line 1", "99999", "between 1 and 65535"),
    ("w1:0 slots=1", "hostfile line 1", "0", "between 1 and 65535"),
    ("fd00::3 slots=1", "hostfile line 1", "fd00::3", "IPv6 in brackets"),
    ("$(reboot) slots=1", "hostfile line 1", "$(reboot)", "[user@]host[:port]"),
    ("w1 slots=1\n\nw1 slots=2", "hostfile line 3", "w1 slots=2", "already on line 1"),
    ("# only a comment\n", "hostfile", "# only a comment\n", "at least one host line"),
])
def test_bad_lines_name_the_line_and_the_value(text, field, value, allowed):
    with pytest.raises(SpecError) as err:
        parse_hostfile_text(text)
    assert (err.value.field, err.value.value) == (field, value)
    assert allowed in err.value.allowed


def test_read_hostfile_names_the_file(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("w1 slots=2\nw2 slots=x\n")
    with pytest.raises(SpecError) as err:
        read_hostfile(str(path))
    assert err.value.field == f"hostfile {path} line 2" and err.value.value == "x"
    with pytest.raises(SpecError, match="a readable file"):
        read_hostfile(str(tmp_path / "missing"))


def test_inline_hosts_accept_a_list_or_a_comma_string():
    assert [e.host for e in coerce_hosts("a slots=1, b slots=1")] == ["a", "b"]
    assert [e.port for e in coerce_hosts(["a:2201 slots=1", "a:2202 slots=1"])] == [2201, 2202]
    with pytest.raises(SpecError, match="list of hostfile lines"):
        coerce_hosts(42)


def test_spec_selects_the_first_nodes_hosts_and_checks_slots(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb slots=1\nc slots=4\n")
    spec = LaunchSpec(command=["train.py"], backend="ssh", backend_options={"hostfile": str(path)}, nodes=1,
                      procs_per_node=2)
    assert [h.host for h in spec.resolved.hosts] == ["a"]
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=["train.py"], backend="ssh", backend_options={"hostfile": str(path)}, nodes=2,
                   procs_per_node=2)
    assert err.value.field == "procs_per_node" and f"{path} line 2" in err.value.allowed
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=["train.py"], backend="ssh", backend_options={"hosts": ["a slots=2"]}, nodes=2)
    assert err.value.field == "nodes" and "at most the 1 host(s)" in err.value.allowed


@pytest.mark.parametrize("kwargs, field", [
    ({"backend": "ssh"}, "hostfile"),
    ({"backend": "local", "backend_options": {"hosts": ["a"]}}, "backend_options['local']"),
    ({"backend": "local", "backend_options": {"user": "bob"}}, "backend_options['local']"),
    ({"backend": "nosuch"}, "backend"),
    ({"backend": "ssh", "backend_options": {"hosts": ["a"], "hostfile": "/x"}}, "hosts"),
    ({"backend": "ssh", "backend_options": {"hosts": ["a"], "user": "-oProxyCommand=x"}}, "ssh.user"),
    ({"backend": "ssh", "backend_options": {"hosts": ["a"], "port": "70000"}}, "ssh.port"),
    ({"backend": "ssh", "backend_options": {"hosts": ["a"], "key_file": "/nonexistent/key"}}, "ssh.key_file"),
    ({"backend": "ssh", "backend_options": {"hosts": ["a"], "strict_host_key_checking": "maybe"}},
     "ssh.strict_host_key_checking"),
    ({"backend": "ssh", "backend_options": {"hosts": ["a"], "python": "python3"}}, "ssh.python"),
    ({"backend": "ssh", "backend_options": {"hosts": ["a"], "password": "x"}}, "backend_options['ssh']"),
    ({"backend": "ssh", "backend_options": {"hosts": ["a"], "conn_id": "c"}}, "backend_options['ssh'].conn_id"),
    ({"backend": "slurm", "backend_options": {"partition": "a b"}}, "partition"),
    ({"backend": "slurm", "backend_options": {"qos": "high"}}, "slurm_options"),
    ({"mpi_options": ["--oversubscribe"]}, "mpi_options"),
    ({"distribution": "mpi", "nodes": 2}, "nodes"),
    ({"parameter_servers": 1}, "parameter_servers"),
    ({"distribution": "tensorflow", "parameter_servers": 2, "procs_per_node": 2}, "parameter_servers"),
])
def test_spec_refuses_misplaced_or_bad_remote_fields(kwargs, field):
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=["true"], **kwargs)
    assert err.value.field == field


def test_ssh_settings_normalise_and_serialise(tmp_path):
    key = tmp_path / "id"
    key.write_text("not read, only checked to exist")
    settings = SSHSettings.from_mapping('{"user": "bob", "port": "2222", "key_file": "%s"}' % key)
    assert settings.to_dict() == {"user": "bob", "port": 2222, "key_file": str(key),
                                  "strict_host_key_checking": "accept-new", "connect_timeout": 10,
                                  "fanout": 32, "poll_interval": 2.0, "max_poll_interval": 30.0, "lost_after": 30.0}
    with pytest.raises(SpecError, match="without blanks"):
        SSHSettings.from_mapping({"known_hosts_file": str(tmp_path / "known hosts")})


@pytest.mark.parametrize("settings, field, allowed", [
    ({"fanout": 0}, "ssh.fanout", "at least 1"),
    ({"fanout": 5000}, "ssh.fanout", "at most 1024"),
    ({"fanout": "all"}, "ssh.fanout", "integer"),
    ({"poll_interval": -1}, "ssh.poll_interval", "between 0 and 3600"),
    ({"poll_interval": 10, "max_poll_interval": 5}, "ssh.max_poll_interval", "at least poll_interval (10 s)"),
    ({"lost_after": 10}, "ssh.lost_after", "greater than 10"),
])
def test_fanout_and_poll_settings_are_bounded(settings, field, allowed):
    with pytest.raises(SpecError) as err:
        SSHSettings.from_mapping(settings)
    assert err.value.field == field and allowed in str(err.value)


def test_a_poll_interval_above_the_default_cap_raises_the_cap_with_it():
    assert SSHSettings.from_mapping({"poll_interval": 60}).max_poll_interval == 60.0
    assert SSHSettings.from_mapping({"fanout": "8"}).fanout == 8


def test_hosts_and_settings_from_an_airflow_ssh_connection():
    from airflow.sdk import Connection

    conn = Connection(conn_id="gpu_cluster", conn_type="ssh", host="gpu-1, gpu-2", login="train", port=2222,
                      extra='{"key_file": "/keys/id", "no_host_key_check": "true", "conn_timeout": 5}')
    assert from_airflow_connection(conn) == (
        ["gpu-1", "gpu-2"],
        {"user": "train", "port": 2222, "key_file": "/keys/id", "strict_host_key_checking": "no", "connect_timeout": 5},
    )
    conn = Connection(conn_id="c", conn_type="ssh", host="ignored", extra='{"hosts": ["a slots=8", "b slots=8"]}')
    assert from_airflow_connection(conn)[0] == ["a slots=8", "b slots=8"]
    conn = Connection(conn_id="c", conn_type="ssh", host="a", extra='{"private_key": "-----BEGIN..."}')
    with pytest.raises(SpecError, match="key_file"):
        from_airflow_connection(conn)


def test_cli_refuses_a_bad_fanout_with_exit_2_naming_it(tmp_path):
    import subprocess
    import sys

    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=1\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dtrain"), "launch", "--backend", "ssh",
                           "--hostfile", str(hostfile), "--ssh-fanout", "0", "--run-dir", str(run_dir), "--",
                           "python", "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "ssh.fanout=0" in proc.stderr and "at least 1" in proc.stderr, proc.stderr
    assert not run_dir.exists()
