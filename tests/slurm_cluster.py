"""A real two-node Slurm cluster on this machine, for tests and CI: munged, slurmctld, two slurmd.

Everything lives under one temporary directory: the munge key and socket, slurm.conf,
state, spool, pid and log files. The client commands (sbatch, squeue, scontrol,
scancel) find the cluster through ``SLURM_CONF``; munge is reached through the
private socket named in ``AuthInfo``, so nothing in /etc or /run is touched and a
system munged/slurm, if any, is left alone.

Every daemon starts in the foreground as our own child (so we hold its PID) and
carries the marker variable ``DTRAIN_SLURM_TEST_CLUSTER=<root>``; job processes
carry ``SLURM_CONF=<root>/slurm.conf`` from the submitting environment.
``stop()`` cancels every job, stops the daemons and then kills, by PID, any
process still carrying either marker (slurmstepd re-parents itself to init, so
ancestry alone would miss it). Needs root: slurmd runs jobs as their user.

Run by hand: ``python tests/slurm_cluster.py`` starts a cluster (``--hosts 2``: on namespace hosts
with their own addresses, as the suite runs it), prints the ``SLURM_CONF`` to export, and stops it on
Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil

MARKER = "DTRAIN_SLURM_TEST_CLUSTER"
REQUIRED_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")


def missing_binaries() -> list[str]:
    return [b for b in REQUIRED_BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """Start with ``start()``, stop with ``stop()``; ``env`` is what client commands need."""

    def __init__(self, root: str | None = None, nodes: tuple[str, ...] = ("node1", "node2"), cpus: int = 2,
                 partition: str = "debug", net=None):
        self.own_root = root is None  # made here, so removed at stop()
        self.root = root or tempfile.mkdtemp(prefix="dtrain-slurm-")
        # On a tests.netcluster.NetCluster each node's slurmd runs on its own host (namespace, address,
        # cgroups) with that address as NodeAddr, and slurmctld on this machine at the bridge's address.
        self.net = net
        self.nodes = tuple(f"node{h.index + 1}" for h in net.hosts) if net is not None else nodes
        self.cpus = cpus
        self.partition = partition
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_socket = os.path.join(self.root, "munge", "munge.socket.2")
        self.daemons: dict[str, subprocess.Popen] = {}
        self.hostname = socket.gethostname()

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": self.conf}

    @property
    def controller_address(self) -> str:
        return self.net.gateway if self.net is not None else "127.0.0.1"

    def host(self, node: str):
        """The tests.netcluster host that runs ``node``'s slurmd (None on loopback)."""
        return self.net.hosts[self.nodes.index(node)] if self.net is not None else None

    def node_address(self, node: str) -> str:
        host = self.host(node)
        return host.address if host is not None else "127.0.0.1"

    # -- configuration -------------------------------------------------------------------------
    def write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(self.root, sub), mode=0o755, exist_ok=True)
        key = os.path.join(self.root, "munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400), "wb") as fh:
            fh.write(os.urandom(1024))
        ctld_port = _free_port()
        node_lines = [
            f"NodeName={name} NodeHostname={self.hostname} NodeAddr={self.node_address(name)} Port={_free_port()} "
            f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
            for name in self.nodes
        ]
        r = self.root
        lines = [
            "ClusterName=dtraintest",
            f"SlurmctldHost={self.hostname}({self.controller_address})",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            # No cgroups, no accounting here: the sandbox has neither (see DESIGN.md's facts).
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            # Short timers keep the tests quick: scancel escalates to SIGKILL after KillWait.
            "KillWait=2",
            "MinJobAge=300",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            "MessageTimeout=10",
            *node_lines,
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        tmp = self.conf + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        os.replace(tmp, self.conf)
        with open(os.path.join(r, "cgroup.conf"), "w", encoding="utf-8") as fh:
            fh.write("CgroupAutomount=no\n")

    # -- lifecycle -----------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], host=None) -> None:
        env = dict(os.environ, SLURM_CONF=self.conf, **{MARKER: self.root})
        log = open(os.path.join(self.root, "log", f"{name}.stdout"), "ab")
        try:
            if host is not None:  # on its host, but with this machine's /sys: slurmd needs /sys/fs/cgroup
                self.daemons[name] = host.popen(argv, sysfs=False, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT)
            else:
                self.daemons[name] = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                                      stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        kill_stale_clusters()
        self.write_config()
        m = os.path.join(self.root, "munge")
        self._spawn("munged", [_binary("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid",
                               f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"])
        self._wait_for(lambda: os.path.exists(self.munge_socket), 15, "munged socket")
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", self.conf])
        for node in self.nodes:
            os.makedirs(os.path.join(self.root, "spool", node), exist_ok=True)
            self._start_slurmd(node)
        try:
            self._wait_for(self._all_idle, timeout, "both nodes idle in sinfo")
        except Exception:
            self.stop()
            raise
        return self

    def _start_slurmd(self, node: str) -> None:
        self._spawn(f"slurmd-{node}", [_binary("slurmd"), "-D", "-N", node, "-f", self.conf], self.host(node))

    def reboot(self, index: int, timeout: float = 30.0) -> None:
        """Start host ``index``'s slurmd again after a crash killed it (a host that rebooted: same address,
        same spool), and wait until slurmctld has heard from it (sinfo's state loses its "*": not responding)."""
        node = self.nodes[index]
        self._start_slurmd(node)

        def responding() -> bool:
            out = self.run(["sinfo", "-h", "-n", node, "-o", "%t"], check=False).stdout.strip()
            return bool(out) and not out.endswith("*")
        self._wait_for(responding, timeout, f"{node}'s slurmd to register again")

    def _all_idle(self) -> bool:
        for name, proc in self.daemons.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} during start-up; logs:\n{self.logs()}")
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.25)
        raise RuntimeError(f"slurm test cluster: timed out waiting for {what}; logs:\n{self.logs()}")

    def run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=dict(os.environ, **self.env), capture_output=True, text=True,
                              check=check, timeout=30)

    def logs(self, lines: int = 15) -> str:
        out = []
        for folder in (os.path.join(self.root, "log"), os.path.join(self.root, "munge")):
            for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
                if name.endswith((".log", ".stdout")):
                    with open(os.path.join(folder, name), errors="replace") as fh:
                        tail = fh.read().splitlines()[-lines:]
                    out.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(out)

    def pids(self) -> set[int]:
        """Every live process that belongs to this cluster: daemons, slurmstepd, job processes."""
        return processes_with_marker(self.root, self.conf)

    def job_pids(self) -> set[int]:
        """Processes of jobs (slurmstepd and below), not the daemons themselves."""
        daemons = {p.pid for p in self.daemons.values()}
        return self.pids() - daemons

    def stop(self) -> None:
        if any(p.poll() is None for p in self.daemons.values()):
            self.run(["scancel", "--full", f"--partition={self.partition}"], check=False)
            # Wait for the cancel to reach every job, not for each to leave the queue: a job of a node a
            # test broke stays COMPLETING until SlurmdTimeout, and stopping the daemons below, then
            # killing what is left of the cluster's processes, ends it anyway.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(state != "COMPLETING" for _, state in self.jobs(check=False)):
                time.sleep(0.25)
        order = [n for n in self.daemons if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            proc = self.daemons.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        kill_pids(self.pids())
        if self.own_root:  # its state, spool, logs and munge key: nothing of a stopped cluster is read again
            shutil.rmtree(self.root, ignore_errors=True)

    def jobs(self, check: bool = True) -> list[tuple[str, str]]:
        """(job id, state) of every job squeue lists (any state, COMPLETING included)."""
        out = self.run(["squeue", "-h", "-o", "%i %T"], check=check).stdout
        return [(fields[0], fields[-1]) for fields in map(str.split, out.splitlines()) if fields]


def queue(cluster: SlurmCluster) -> list[str]:
    """Job ids squeue still lists (any state, COMPLETING included)."""
    return [job_id for job_id, _ in cluster.jobs()]


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return {}


def processes_with_marker(root: str, conf: str) -> set[int]:
    # Not this test process, its parents, or anything below it: the environment it hands down carries
    # SLURM_CONF, so a helper it or one of its children started (multiprocessing's resource tracker,
    # which lives as long as the process that started it, e.g. an Airflow process a fixture runs)
    # would otherwise count as a job's process. Slurm starts a job's processes under slurmstepd,
    # never under the test process.
    me = psutil.Process()
    skip = {me.pid, *(p.pid for p in me.parents()), *(p.pid for p in me.children(recursive=True))}
    found = set()
    for proc in psutil.process_iter():
        if proc.pid in skip:
            continue
        env = _environ(proc)
        if env.get(MARKER) == root or env.get("SLURM_CONF") == conf:
            found.add(proc.pid)
    return found


def kill_pids(pids: set[int]) -> None:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


def kill_stale_clusters() -> None:
    """Daemons of an earlier test session that died without teardown: their root is gone."""
    stale = set()
    for proc in psutil.process_iter():
        root = _environ(proc).get(MARKER)
        if root and not os.path.isdir(root):
            stale.add(proc.pid)
    kill_pids(stale)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python tests/slurm_cluster.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=0,
                        help="run the nodes on this many namespace hosts with their own addresses "
                             "(tests/netcluster.py); 0: two nodes on 127.0.0.1")
    args = parser.parse_args(argv)
    net = None
    if args.hosts:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.netcluster import NetCluster

        net = NetCluster(args.hosts).start()
    try:
        cluster = SlurmCluster(net=net).start()
        try:
            print(f"export SLURM_CONF={cluster.conf}", flush=True)
            for node in cluster.nodes:
                print(f"  {node}: NodeAddr {cluster.node_address(node)}", flush=True)
            print("Ctrl-C stops it", flush=True)
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        finally:
            cluster.stop()
    finally:
        if net is not None:
            net.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
