"""Each node's socket interface: the one its route to MASTER_ADDR leaves by (dtrain.launch.node.netif),
here and on hosts with their own addresses, where host 0's first interface is a decoy."""

from __future__ import annotations

import json
import subprocess
import sys


from dtrain.launch.node.netif import interface_to, socket_ifname_env


def test_loopback_is_reached_through_lo():
    assert interface_to("127.0.0.1") == "lo"
    assert interface_to("localhost") == "lo"


def test_both_variables_are_set_unless_the_user_set_them():
    assert socket_ifname_env({"MASTER_ADDR": "127.0.0.1"}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert socket_ifname_env({"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth7"}) == {"NCCL_SOCKET_IFNAME": "lo"}
    both = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "a", "NCCL_SOCKET_IFNAME": "b"}
    assert socket_ifname_env(both) == {}


def test_without_a_master_or_a_route_nothing_is_set():
    assert socket_ifname_env({}) == {}
    assert socket_ifname_env({"MASTER_ADDR": "no-such-host.invalid"}) == {}


PROBE = ("import json, sys; from dtrain.launch.node.netif import socket_ifname_env; "
         "print(json.dumps([socket_ifname_env({'MASTER_ADDR': a}) for a in sys.argv[1:]]))")


def test_each_host_finds_its_own_interface_not_the_first_one(net_cluster):
    """Host 0 lists a decoy ``eth0`` (another subnet, routing nowhere) before ``eth1``, its link to
    the others: its choice is eth1, whether MASTER_ADDR is another host or its own address; the
    other hosts' link is their eth0."""
    net = net_cluster.net
    master = net.hosts[0].address
    for host in net.hosts:
        out = host.run([sys.executable, "-c", PROBE, master, net.hosts[1].address], check=True).stdout
        expected = {"GLOO_SOCKET_IFNAME": host.interface, "NCCL_SOCKET_IFNAME": host.interface}
        assert json.loads(out) == [expected, expected], host
    assert net.hosts[0].interface == "eth1"
    decoy = net.hosts[0].run(["ip", "-o", "link", "show"], check=True).stdout
    assert decoy.index(": eth0") < decoy.index(": eth1")  # listed first


def test_ranks_started_by_a_subprocess_see_it(tmp_path):
    """The rank wrapper sets it before the user's command starts (the local backend's path, unchanged)."""
    script = tmp_path / "show.py"
    script.write_text("import os; print(os.environ.get('GLOO_SOCKET_IFNAME'), os.environ.get('NCCL_SOCKET_IFNAME'))")
    env = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "NCCL_SOCKET_IFNAME": "mine", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-m", "dtrain.launch.node.rank_entry", sys.executable, str(script)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("lo mine"), run.stdout
