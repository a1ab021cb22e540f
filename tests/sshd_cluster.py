"""Real OpenSSH sshd instances, one per simulated host, for tests and the benchmark: on 127.0.0.1
(one port each), or each on its own host of a namespace cluster (tests/netcluster.py, port 22).

Each "host" is an sshd with its own port, host key, pid file and config in a
temp directory, accepting one generated ed25519 client key (AuthorizedKeysFile,
StrictModes no: the temp files are not owned the way sshd's strict checks want).
A known_hosts file with every host key is written, so clients run with
StrictHostKeyChecking=yes: nothing is accepted blindly.

The hosts share this machine's filesystem, so the run directory and the package
are "installed on every host" for free; on a real cluster they must be.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field

import psutil

from tests.support import kill_survivors

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SSH_KEYGEN = shutil.which("ssh-keygen") or "/usr/bin/ssh-keygen"
PRIVSEP_DIR = "/run/sshd"  # Debian's sshd refuses to start without it


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: str) -> str:
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "dtrain-test", "-f", path], check=True)
    with open(path + ".pub", encoding="utf-8") as fh:
        return fh.read().strip()


CONFIG = """\
Port {port}
ListenAddress {address}
HostKey {host_key}
PidFile {pid_file}
AuthorizedKeysFile {authorized_keys}
StrictModes no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
PrintMotd no
MaxStartups 64:30:128
MaxSessions 64
LogLevel ERROR
"""


@dataclass
class SSHHost:
    port: int
    directory: str
    proc: subprocess.Popen | None = None
    address: str = "127.0.0.1"
    net_host: object = None  # the tests.netcluster.Host it runs on (None: this machine's loopback)

    @property
    def line(self) -> str:
        """This host as a hostfile entry (without slots)."""
        return f"{self.address}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"


@dataclass
class SSHCluster:
    directory: str
    key_file: str
    known_hosts: str
    hosts: list[SSHHost] = field(default_factory=list)
    net: object = None  # the tests.netcluster.NetCluster the hosts live on (None: 127.0.0.1)

    def hostfile(self, slots: int, path: str | None = None, user: str = "root") -> str:
        """Write a hostfile naming every host (``user@ADDRESS:PORT slots=N``); return its path."""
        path = path or os.path.join(self.directory, f"hostfile-{slots}")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("# written by tests/sshd_cluster.py\n")
            for host in self.hosts:
                fh.write(f"{user}@{host.line} slots={slots}\n")
        return path

    def ssh_settings(self) -> dict[str, str]:
        # No poll backoff: the tests' deferred jobs last seconds, not hours (default: 2 s growing to 30 s).
        return {"key_file": self.key_file, "known_hosts_file": self.known_hosts, "strict_host_key_checking": "yes",
                "max_poll_interval": 2}

    def session_pids(self) -> set[int]:
        """Every process currently below an sshd of this cluster (logged-in sessions and what they run)."""
        pids: set[int] = set()
        for host in self.hosts:
            try:
                pids.update(p.pid for p in psutil.Process(host.proc.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        return pids

    def reboot(self, index: int, timeout: float = 10.0) -> None:
        """Start host ``index``'s sshd again after a crash killed it (a host that rebooted: same keys,
        same address), and wait until it accepts connections."""
        host = self.hosts[index]
        host.proc = _start_sshd(host.directory, host.net_host)
        _wait_listening(host, timeout)

    def stop(self) -> None:
        """Stop every sshd and anything still running in its sessions."""
        victims = []
        for host in self.hosts:
            if host.proc is None:
                continue
            try:
                root = psutil.Process(host.proc.pid)
                victims.extend(root.children(recursive=True))
                victims.append(root)
            except psutil.NoSuchProcess:
                pass
        for proc in victims:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        kill_survivors(victims, timeout=3)
        for host in self.hosts:
            if host.proc is not None:
                try:
                    host.proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    host.proc.kill()


def _same_code() -> str:
    """An sshd_config line giving the hosts' sessions this process's PYTHONPATH (OpenSSH 8.7+), so
    what runs on a "host" is the code under test, not whatever the venv's install points at (a
    checkout run with PYTHONPATH=<worktree> would otherwise test its own launcher against
    another checkout's remote side)."""
    path = os.environ.get("PYTHONPATH")
    if not path:
        return ""
    if any(c in path for c in '"\\\n'):
        raise RuntimeError(f"PYTHONPATH={path!r} cannot be written into an sshd_config")
    return f'SetEnv "PYTHONPATH={path}"\n'


def start_cluster(directory: str, count: int = 2, timeout: float = 10.0, net=None, on=None) -> SSHCluster:
    """Start ``count`` sshd daemons on 127.0.0.1 (separate ports), or with ``net`` (a started
    :class:`tests.netcluster.NetCluster`) one on each of its hosts (or on the hosts ``on`` names: its
    address, port 22, in its namespace and cgroups), and wait until each accepts connections."""
    os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)
    os.makedirs(directory, exist_ok=True)
    key_file = os.path.join(directory, "id_ed25519")
    client_pub = _keygen(key_file)
    authorized = os.path.join(directory, "authorized_keys")
    with open(authorized, "w", encoding="utf-8") as fh:
        fh.write(client_pub + "\n")
    os.chmod(authorized, 0o600)
    cluster = SSHCluster(directory=directory, key_file=key_file, known_hosts=os.path.join(directory, "known_hosts"),
                         net=net)
    known = []
    try:
        net_hosts = (on if on is not None else net.hosts) if net is not None else [None] * count
        for index, net_host in enumerate(net_hosts):
            host_dir = os.path.join(directory, f"host{index}")
            os.makedirs(host_dir)
            host = SSHHost(port=22, directory=host_dir, address=net_host.address, net_host=net_host) if net_host \
                else SSHHost(port=_free_port(), directory=host_dir)
            host_key = os.path.join(host_dir, "ssh_host_ed25519_key")
            host_pub = _keygen(host_key)
            known.append(f"{host.known_hosts_name} {' '.join(host_pub.split()[:2])}")
            config = os.path.join(host_dir, "sshd_config")
            with open(config, "w", encoding="utf-8") as fh:
                fh.write(CONFIG.format(port=host.port, address=host.address, host_key=host_key,
                                       pid_file=os.path.join(host_dir, "sshd.pid"), authorized_keys=authorized)
                         + _same_code())
            host.proc = _start_sshd(host_dir, net_host)
            cluster.hosts.append(host)
        with open(cluster.known_hosts, "w", encoding="utf-8") as fh:
            fh.write("\n".join(known) + "\n")
        for host in cluster.hosts:
            _wait_listening(host, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start_sshd(host_dir: str, net_host=None) -> subprocess.Popen:
    """The sshd of the host whose config is in ``host_dir``, in ``net_host``'s namespace if given."""
    with open(os.path.join(host_dir, "sshd.log"), "ab") as log:
        # -D: stay in the foreground, so this Popen is the daemon and stop() can reach it.
        argv = [SSHD, "-D", "-e", "-f", os.path.join(host_dir, "sshd_config")]
        kwargs = dict(stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        return net_host.popen(argv, **kwargs) if net_host is not None else subprocess.Popen(argv, **kwargs)


def _wait_listening(host: SSHHost, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if host.proc.poll() is not None:
            with open(os.path.join(host.directory, "sshd.log"), encoding="utf-8", errors="replace") as fh:
                raise RuntimeError(f"sshd on {host.line} exited with {host.proc.returncode}: {fh.read()}")
        try:
            with socket.create_connection((host.address, host.port), timeout=0.5) as s:
                if s.recv(4).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd on {host.line} did not accept connections within {timeout}s")
