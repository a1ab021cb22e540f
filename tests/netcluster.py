"""Hosts with their own addresses on one machine: network namespaces on a bridge, and their faults.

Every host is a network namespace with its own address on a private /24, reached through a veth
pair plugged into a Linux bridge in the root namespace (which holds the subnet's first address, so
the launcher on this machine reaches every host, and the hosts reach each other). Each host has its
own loopback, routing table and resolver configuration (lookups fail at once: :data:`HOST_RESOLV_CONF`);
the filesystem, the process table and the hostname are shared (the
hostname resolves to 127.0.0.1, as on many images: software that advertises "the address of my
hostname" fails across hosts, as it does on real clusters). Host 0 has a second interface,
``eth0``, listed before the one that reaches the others and routing nowhere: a program that picks
"the first interface" picks the wrong one there.

Faults, as a real cluster has them (DESIGN.md, "Real hosts on one machine"):

* :meth:`NetCluster.partition` / :meth:`NetCluster.heal`: the host's link goes down / up (a cut cable,
  a dead switch port); its processes run on, unreachable;
* :meth:`NetCluster.freeze` / :meth:`NetCluster.thaw`: every process of the host stops (cgroup v1
  freezer: a hung kernel, a VM paused); connections stay open, nothing answers;
* :meth:`NetCluster.crash`: every process of the host is killed (a power cut);
* :meth:`NetCluster.slow_cpu`: the host gets a fraction of one CPU (cgroup v1 cfs quota);
* :meth:`NetCluster.slow_link`: the host's link is rate-limited (``tc qdisc tbf``).

Processes started with :meth:`Host.popen` join the host's cgroups (so a freeze or a quota reaches
everything they start, sshd's sessions included).

By hand (as root): ``python -m tests.netcluster --hosts 3`` starts a cluster with an sshd on each
host, prints its hosts and how to log in, and removes everything on Ctrl-C.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"
#: where ``ip netns exec`` finds a namespace's own /etc files
NETNS_ETC = "/etc/netns"
#: each host's resolver: its own loopback, where nothing listens, so a lookup fails at once. With this
#: machine's resolver the hosts cannot reach (no route out of the bridge) every lookup waited 10 s, and
#: c10d looks up each peer's name as its store accepts it: 10-14 s more per job, per restart
HOST_RESOLV_CONF = ("# tests/netcluster.py: lookups fail at once (nothing listens on this host's port 53)\n"
                    "nameserver 127.0.0.1\n")
CGROUP_V1 = "/sys/fs/cgroup"
#: every name this module creates starts with this (namespaces, links, cgroups): the orphan check looks for it
PREFIX = "dtn"
#: the private range the clusters' subnets are taken from (a /24 each)
SUPERNET = ipaddress.ip_network("10.231.0.0/16")
#: host 0's decoy interface: a subnet that routes nowhere
DECOY_SUPERNET = ipaddress.ip_network("172.31.0.0/16")
HOST_OFFSET = 11  # host i has address .(11 + i); .1 is the bridge


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, check=check)


def _used_subnets() -> set[ipaddress.IPv4Network]:
    found = set()
    for line in ip("-4", "-o", "addr", "show").stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            found.add(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return found


def _free_subnet(supernet: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
    used = _used_subnets()
    candidates = list(supernet.subnets(new_prefix=24))
    for _ in range(64):
        net = candidates[secrets.randbelow(len(candidates))]
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError(f"no free /24 in {supernet}")


@dataclass
class Host:
    """One simulated machine: a network namespace and the cgroups its processes join."""
    index: int
    netns: str
    address: str
    veth: str  # the host-side end, in the root namespace (a fault's handle)
    cgroup: str  # the name of its cgroups under cpu/ and freezer/
    interface: str  # the namespace's interface that reaches the other hosts

    def argv(self, argv: list[str], sysfs: bool = True) -> list[str]:
        """``argv`` run inside this host's network namespace, with the host's resolver configuration
        (:data:`HOST_RESOLV_CONF`: ``ip netns exec`` mounts /etc/netns/<name>/resolv.conf over
        /etc/resolv.conf). ``ip netns exec`` also mounts the namespace's own /sys (its interfaces), which
        has no cgroup filesystem under it; ``sysfs=False`` keeps this machine's /sys instead (slurmd
        refuses to start without /sys/fs/cgroup): it enters the network namespace and a mount namespace
        of its own, where only the resolver configuration is mounted."""
        if not sysfs:
            return [NSENTER, f"--net=/run/netns/{self.netns}", UNSHARE, "--mount", "--propagation", "private",
                    "sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"', self.resolv_conf, *argv]
        return [IP, "netns", "exec", self.netns, *argv]

    @property
    def resolv_conf(self) -> str:
        return os.path.join(NETNS_ETC, self.netns, "resolv.conf")

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(argv), preexec_fn=self._join_cgroups, **kwargs)

    def popen(self, argv: list[str], sysfs: bool = True, **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this host: in its namespace and its cgroups (a daemon: its own session)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.argv(argv, sysfs), preexec_fn=self._join_cgroups, **kwargs)

    def _join_cgroups(self) -> None:
        pid = str(os.getpid()).encode()
        for controller in ("freezer", "cpu"):
            fd = os.open(os.path.join(CGROUP_V1, controller, self.cgroup, "cgroup.procs"), os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)

    def pids(self) -> set[int]:
        """Every process whose network namespace is this host's."""
        out = ip("netns", "pids", self.netns, check=False).stdout
        return {int(p) for p in out.split() if p.isdigit()}


@dataclass
class NetCluster:
    count: int
    decoy: bool = True  # host 0's decoy interface (eth0, listed first; its link is eth1)
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    hosts: list[Host] = field(default_factory=list)
    subnet: ipaddress.IPv4Network | None = None
    bridge: str = ""

    @property
    def gateway(self) -> str:
        """The bridge's address: this machine (the launcher, the test's services) as the hosts see it."""
        return str(self.subnet.network_address + 1)

    def start(self) -> "NetCluster":
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root")
        self.subnet = _free_subnet(SUPERNET)
        self.bridge = f"{PREFIX}{self.tag}br"
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for index in range(self.count):
                self._add_host(index)
        except BaseException:
            self.stop()
            raise
        return self

    def _add_host(self, index: int) -> Host:
        name = f"{PREFIX}{self.tag}h{index}"
        address = str(self.subnet.network_address + HOST_OFFSET + index)
        decoy = index == 0 and self.decoy
        inside = "eth1" if decoy else "eth0"
        host = Host(index=index, netns=name, address=address, veth=f"{name}v", cgroup=name, interface=inside)
        self.hosts.append(host)  # before anything can fail: stop() removes what was made of it
        ip("netns", "add", name)
        os.makedirs(os.path.dirname(host.resolv_conf), exist_ok=True)
        with open(host.resolv_conf, "w", encoding="utf-8") as fh:
            fh.write(HOST_RESOLV_CONF)
        ip("link", "add", host.veth, "type", "veth", "peer", "name", f"{name}p")
        if decoy:  # created first: it is listed before the interface that works
            subnet = _free_subnet(DECOY_SUPERNET)
            # A veth pair with both ends in the namespace (this kernel has no dummy links): up, addressed,
            # and leading nowhere.
            ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", "decoy")
            ip("-n", name, "addr", "add", f"{subnet.network_address + 2}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "decoy", "up")
            ip("-n", name, "link", "set", "eth0", "up")
        ip("link", "set", f"{name}p", "netns", name)
        ip("-n", name, "link", "set", f"{name}p", "name", inside)
        ip("-n", name, "addr", "add", f"{address}/24", "dev", inside)
        ip("-n", name, "link", "set", inside, "up")
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "route", "add", "default", "via", self.gateway)
        ip("link", "set", host.veth, "master", self.bridge)
        ip("link", "set", host.veth, "up")
        for controller in ("freezer", "cpu"):
            os.makedirs(os.path.join(CGROUP_V1, controller, host.cgroup), exist_ok=True)
        return host

    # -- faults --------------------------------------------------------------------------------------

    def partition(self, index: int) -> None:
        ip("link", "set", self.hosts[index].veth, "down")

    def heal(self, index: int) -> None:
        ip("link", "set", self.hosts[index].veth, "up")

    def freeze(self, index: int) -> None:
        self._cgroup_write("freezer", self.hosts[index], "freezer.state", "FROZEN")

    def thaw(self, index: int) -> None:
        self._cgroup_write("freezer", self.hosts[index], "freezer.state", "THAWED")

    def crash(self, index: int) -> None:
        """Kill every process of the host at once, as a machine's crash does: frozen while they are
        signalled one by one (else a probe can find its sshd alive after its sessions died), then thawed
        to die together (a frozen process cannot die)."""
        host = self.hosts[index]
        self.freeze(index)
        try:
            for _ in range(20):  # processes that were forking as the first pass ran
                pids = host.pids()
                if not pids:
                    return
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.thaw(index)
                time.sleep(0.05)
        finally:
            self.thaw(index)
        raise RuntimeError(f"host {index} still has processes: {sorted(host.pids())}")

    def slow_cpu(self, index: int, fraction: float) -> None:
        """Give every process of the host ``fraction`` of one CPU together (cfs quota per 10 ms: a step of
        tens of ms is slowed throughout, as on a slower machine; with the default 100 ms period a rank
        ran whole steps at full speed, then nothing for the rest of the period)."""
        period = 10_000
        host = self.hosts[index]
        self._cgroup_write("cpu", host, "cpu.cfs_period_us", str(period))
        self._cgroup_write("cpu", host, "cpu.cfs_quota_us", str(max(1000, int(period * fraction))))

    def full_cpu(self, index: int) -> None:
        self._cgroup_write("cpu", self.hosts[index], "cpu.cfs_quota_us", "-1")

    def slow_link(self, index: int, mbit: float = 1.0) -> None:
        """Rate-limit what the host receives to ``mbit`` megabits a second (its bridge port's egress; netem is
        not in this kernel). The bucket holds 20 ms of the rate (at least 4 KB): a smaller one caps the
        rate at the bucket times the kernel's timer frequency (4 KB gave about 8 mbit whatever was asked)."""
        veth = self.hosts[index].veth
        burst = max(4096, int(mbit * 1e6 / 8 * 0.02))
        subprocess.run([TC, "qdisc", "replace", "dev", veth, "root", "tbf", "rate", f"{mbit:g}mbit", "burst",
                        str(burst), "latency", "400ms"], check=True, capture_output=True)

    def fast_link(self, index: int) -> None:
        subprocess.run([TC, "qdisc", "del", "dev", self.hosts[index].veth, "root"], capture_output=True)

    @staticmethod
    def _cgroup_write(controller: str, host: Host, name: str, value: str) -> None:
        with open(os.path.join(CGROUP_V1, controller, host.cgroup, name), "w", encoding="utf-8") as fh:
            fh.write(value)

    # -- teardown ------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Kill every process of every host, then remove the namespaces, links, bridge and cgroups.
        Safe to call twice and after a failed start."""
        for host in self.hosts:
            try:
                self.crash(host.index)
            except (OSError, RuntimeError):
                pass
        for host in self.hosts:
            ip("link", "del", host.veth, check=False)
            ip("netns", "del", host.netns, check=False)
            shutil.rmtree(os.path.dirname(host.resolv_conf), ignore_errors=True)
            for controller in ("freezer", "cpu"):
                path = os.path.join(CGROUP_V1, controller, host.cgroup)
                for _ in range(50):  # rmdir fails while a killed process is still being reaped
                    try:
                        os.rmdir(path)
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.1)
        if self.bridge:
            ip("link", "del", self.bridge, check=False)
        self.hosts.clear()


def leftovers() -> list[str]:
    """What clusters of this module left on the machine (namespaces, links, cgroups): for the orphan check."""
    found = [f"netns {n.split()[0]}" for n in ip("netns", "list", check=False).stdout.splitlines()
             if n.startswith(PREFIX)]
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(PREFIX):
            found.append(f"link {name}")
    for controller in ("freezer", "cpu"):
        root = os.path.join(CGROUP_V1, controller)
        if os.path.isdir(root):
            found.extend(f"cgroup {controller}/{n}" for n in os.listdir(root) if n.startswith(PREFIX))
    if os.path.isdir(NETNS_ETC):
        found.extend(f"{NETNS_ETC}/{n}" for n in os.listdir(NETNS_ETC) if n.startswith(PREFIX))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.netcluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--leftovers", action="store_true", help="list what clusters left behind, and exit")
    args = parser.parse_args(argv)
    if args.leftovers:
        left = leftovers()
        print("\n".join(left) if left else "nothing left")
        return 1 if left else 0
    import tempfile

    from tests.sshd_cluster import start_cluster

    net = NetCluster(args.hosts).start()
    directory = tempfile.mkdtemp(prefix="dtrain-netcluster-")
    try:
        ssh = start_cluster(directory, net=net)
        try:
            print(f"{args.hosts} hosts on {net.subnet} (this machine: {net.gateway}); hostfile {ssh.hostfile(2)}")
            for host in net.hosts:
                print(f"  host {host.index}: {host.address} netns {host.netns} "
                      f"(ssh -i {ssh.key_file} -o UserKnownHostsFile={ssh.known_hosts} root@{host.address})")
            print("Ctrl-C stops it")
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        finally:
            ssh.stop()
    finally:
        net.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
