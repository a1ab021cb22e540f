"""The namespace test cluster itself (tests/netcluster.py): its hosts are separate on the network, and
each fault it injects is the real thing (the fault tests rely on these)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.netcluster import NetCluster, leftovers

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

#: prints ok when the host's sshd answers (its banner: a frozen host's kernel still completes the TCP
#: handshake here, as the namespaces share this machine's kernel, but nobody speaks)
CONNECT = ("import socket, sys; s = socket.create_connection((sys.argv[1], 22), timeout=2); s.settimeout(2); "
           "print('ok' if s.recv(4) == b'SSH-' else 'no')")
#: spins for 2 s of wall time, prints the share of one CPU it got
SPIN = "import time; end = time.time() + 2\nwhile time.time() < end: pass\nprint(time.process_time() / 2)"


def reaches(net, source: int, target: int) -> bool:
    run = net.hosts[source].run([sys.executable, "-c", CONNECT, net.hosts[target].address], timeout=30)
    return run.stdout.strip() == "ok"


def test_hosts_have_their_own_addresses_and_reach_each_other_and_this_machine(net_cluster):
    net = net_cluster.net
    addresses = [h.address for h in net.hosts]
    assert len(set(addresses)) == 3 and "127.0.0.1" not in addresses
    for host in net.hosts:
        shown = host.run(["ip", "-4", "-o", "addr", "show"], check=True).stdout
        assert f" {host.address}/24" in shown and all(f" {a}/" not in shown for a in addresses if a != host.address)
    assert reaches(net, 0, 2) and reaches(net, 2, 1)


def test_each_host_has_its_own_resolver_and_keeps_the_cgroups_when_asked(net_cluster):
    """Lookups on a host fail at once (its own resolv.conf) whichever way it is entered: with its own /sys
    (``ip netns exec``, as sshd runs) or with this machine's, where slurmd finds /sys/fs/cgroup."""
    from tests.netcluster import HOST_RESOLV_CONF

    host = net_cluster.net.hosts[1]
    with open("/etc/resolv.conf", encoding="utf-8") as fh:
        assert fh.read() != HOST_RESOLV_CONF  # this machine's is left alone
    for sysfs in (True, False):
        seen = subprocess.run(host.argv(["cat", "/etc/resolv.conf"], sysfs), capture_output=True, text=True, check=True)
        assert seen.stdout == HOST_RESOLV_CONF, sysfs
        addresses = subprocess.run(host.argv(["ip", "-4", "-o", "addr", "show"], sysfs), capture_output=True,
                                   text=True, check=True).stdout
        assert f" {host.address}/24" in addresses, sysfs  # in the host's network either way
    cgroups = subprocess.run(host.argv(["ls", "/sys/fs/cgroup"], sysfs=False), capture_output=True, text=True)
    assert "freezer" in cgroups.stdout.split(), cgroups


def test_a_partitioned_host_is_cut_off_until_healed(net_cluster):
    net = net_cluster.net
    net.partition(1)
    try:
        assert not reaches(net, 0, 1) and not reaches(net, 1, 2)
        assert reaches(net, 0, 2)  # the others are not affected
    finally:
        net.heal(1)
    assert reaches(net, 0, 1)


def test_a_frozen_host_stops_every_process_until_thawed(net_cluster, tmp_path):
    net = net_cluster.net
    ticks = tmp_path / "ticks"
    proc = net.hosts[2].popen([sys.executable, "-c",
                               f"import time\nwhile True:\n    open({str(ticks)!r}, 'a').write('.')\n    time.sleep(0.05)"])
    try:
        deadline = time.monotonic() + 30
        while (not ticks.exists() or ticks.stat().st_size < 3) and time.monotonic() < deadline:
            time.sleep(0.05)
        net.freeze(2)
        time.sleep(0.3)  # a tick already past its write lands
        frozen_at = ticks.stat().st_size
        time.sleep(1.0)
        assert ticks.stat().st_size == frozen_at
        assert not reaches(net, 0, 2)  # its sshd is frozen too: nobody answers
        net.thaw(2)
        time.sleep(0.5)
        assert ticks.stat().st_size > frozen_at
    finally:
        net.thaw(2)
        proc.kill()
        proc.wait(timeout=10)


def test_a_crashed_host_has_no_process_left():
    """On a cluster of its own (a crash kills the host's sshd, which the shared fixture needs)."""
    net = NetCluster(2).start()
    try:
        procs = [net.hosts[1].popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
        deadline = time.monotonic() + 30  # each is in the namespace once `ip netns exec` has entered it
        while len(net.hosts[1].pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(net.hosts[1].pids()) == 2
        net.crash(1)
        assert net.hosts[1].pids() == set()
        assert all(p.wait(timeout=10) == -9 for p in procs)
    finally:
        net.stop()
    assert not [thing for thing in leftovers() if net.tag in thing]


def throttled(net, index: int) -> int:
    with open(f"/sys/fs/cgroup/cpu/{net.hosts[index].cgroup}/cpu.stat", encoding="utf-8") as fh:
        return int(dict(line.split() for line in fh)["nr_throttled"])


def test_a_slow_host_gets_its_fraction_of_a_cpu(net_cluster):
    net = net_cluster.net
    before = throttled(net, 1)
    net.slow_cpu(1, 0.2)
    try:
        share = float(net.hosts[1].run([sys.executable, "-c", SPIN], check=True, timeout=60).stdout)
    finally:
        net.full_cpu(1)
    assert share < 0.3 and throttled(net, 1) > before, share


def test_a_slow_link_is_rate_limited(net_cluster):
    net = net_cluster.net
    net.slow_link(2, 1)
    try:
        shown = subprocess.run(["tc", "qdisc", "show", "dev", net.hosts[2].veth], capture_output=True, text=True).stdout
        assert "tbf" in shown and "rate 1Mbit" in shown
    finally:
        net.fast_link(2)
    assert "tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", net.hosts[2].veth], capture_output=True,
                                       text=True).stdout


@pytest.mark.parametrize("failing_step", ["netns", "veth"])
def test_a_failed_start_leaves_nothing(monkeypatch, failing_step):
    import tests.netcluster as netcluster

    real = netcluster.ip
    calls = {"n": 0}

    def is_step(args) -> bool:
        return args[:2] == ("netns", "add") if failing_step == "netns" else (args[:2] == ("link", "add")
                                                                             and "veth" in args)

    def flaky(*args, check=True):
        if is_step(args):
            calls["n"] += 1
            if calls["n"] == 2:  # the second host's
                raise subprocess.CalledProcessError(2, ["ip", *args])
        return real(*args, check=check)

    monkeypatch.setattr(netcluster, "ip", flaky)
    net = NetCluster(3)
    with pytest.raises(subprocess.CalledProcessError):
        net.start()
    assert not [thing for thing in leftovers() if net.tag in thing]
