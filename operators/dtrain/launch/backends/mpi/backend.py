"""distribution=mpi on the local or SSH hosts: one ``mpirun`` starts every rank.

The Launcher routes ``distribution='mpi'`` here for backend ``local`` (one host,
``--host localhost:P``) and ``ssh`` (the hostfile's hosts). For SSH hosts mpirun
reaches them with ``ssh -F <run_dir>/mpi/ssh_config``: a generated config with one
alias per host (``dtrain-node0``...) carrying its address, port, user, key and
host-key policy, so per-host ports and users work, and node order = hostfile order.

MASTER_ADDR (first host) and MASTER_PORT (free there) are exported to every rank
with ``-x NAME``, as are the job's variables; values stay out of argv.

Teardown: SIGTERM to mpirun first (it stops the ranks on every host through its
daemons), then the supervisor's process-tree teardown after the grace period. A
killed mpirun also stops the remote ranks: each orted exits when it loses mpirun.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from operators.errors import LaunchError
from operators.launch.backends.base import Backend, BackendOutcome
from operators.launch.backends.ssh import is_loopback, probe_port
from operators.launch.hostfile import HostEntry, SSHSettings
from operators.launch.job import Job, free_port
from operators.launch.mpi import mpirun_argv, mpirun_env
from operators.launch.processes import NodeSupervisor

LOOPBACK = "127.0.0.1"


def ssh_config_text(hosts: list[HostEntry], settings: SSHSettings) -> str:
    """An ssh_config with one ``Host dtrain-nodeN`` alias per host. Values were validated
    (names, ports, paths without blanks), so no line can smuggle another option."""
    blocks = []
    for i, host in enumerate(hosts):
        lines = [f"Host dtrain-node{i}", f"  HostName {host.address}", "  BatchMode yes",
                 f"  StrictHostKeyChecking {settings.strict_host_key_checking}",
                 f"  ConnectTimeout {settings.connect_timeout}", "  LogLevel ERROR"]
        port = host.port or settings.port
        if port:
            lines.append(f"  Port {port}")
        user = host.user or settings.user
        if user:
            lines.append(f"  User {user}")
        if settings.key_file:
            lines += [f"  IdentityFile {settings.key_file}", "  IdentitiesOnly yes"]
        if settings.known_hosts_file:
            lines.append(f"  UserKnownHostsFile {settings.known_hosts_file}")
        blocks.append("\n".join(lines) + "\n")
    return "".join(blocks)


def mpi_hostfile_text(hosts: list[HostEntry], procs_per_node: int) -> str:
    return "".join(f"dtrain-node{i} slots={procs_per_node}\n" for i in range(len(hosts)))


def _write_private(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


class MPIBackend(Backend):
    name = "mpi"

    def __init__(self, sink=None, grace_seconds: float = 5.0, mpirun: str = "mpirun"):
        super().__init__(**({"sink": sink} if sink else {}))
        self.grace_seconds = grace_seconds
        self.mpirun = mpirun
        self.supervisor = NodeSupervisor(self._mpirun_sink, grace_seconds=grace_seconds)

    def _mpirun_sink(self, line: str) -> None:
        # The supervisor prefixes lines that are not a rank's with its node index; here the
        # one "node" is mpirun itself.
        self.sink("[mpirun] " + line[len("[node0] "):] if line.startswith("[node0] ") else line)

    def run(self, job: Job) -> BackendOutcome:
        spec = job.spec
        try:
            argv, env = self.command(job)
        except LaunchError as e:
            self.sink(f"[dtrain] {e}")
            return BackendOutcome(exit_code=e.exit_code, node_index=0, tail=[str(e)])
        self.sink("[dtrain] mpirun: " + " ".join(argv[: argv.index("-m") - 1]))
        try:
            self.supervisor.start([argv], [env], cwd=spec.workdir)
            code, node = self.supervisor.wait(expected=1)
        finally:
            self._teardown()
        if code == -1:
            return BackendOutcome(exit_code=-1, stopped=True)
        return BackendOutcome(exit_code=code, node_index=None if node is None else 0,
                              tail=[] if node is None else list(node.tail))

    def command(self, job: Job) -> tuple[list[str], dict[str, str]]:
        """mpirun's argv and environment for this job."""
        spec = job.spec
        python = sys.executable
        hostfile = rsh_agent = None
        if spec.backend == "ssh":
            hosts = list(spec.resolved_hosts)
            settings = SSHSettings.from_mapping(spec.ssh)
            python = settings.python or python
            master = hosts[0].address
            port = spec.rdzv_port or probe_port(settings, hosts[0], python)
            mpi_dir = os.path.join(job.run_dir, "mpi")
            if any(c.isspace() for c in mpi_dir):
                # mpirun splits plm_rsh_agent on blanks: the config path must have none.
                raise LaunchError(f"run_dir {job.run_dir!r} must not contain blanks for distribution='mpi' over ssh", 2)
            os.makedirs(mpi_dir, exist_ok=True)
            config, hostfile = os.path.join(mpi_dir, "ssh_config"), os.path.join(mpi_dir, "hostfile")
            _write_private(config, ssh_config_text(hosts, settings))
            _write_private(hostfile, mpi_hostfile_text(hosts, spec.procs_per_node))
            rsh_agent = f"ssh -F {config}"
            loopback = all(is_loopback(h.address) for h in hosts)
        else:
            master, port, loopback = LOOPBACK, spec.rdzv_port or free_port(LOOPBACK), True
        extra = {"MASTER_ADDR": master, "MASTER_PORT": str(port), "AZ_BATCH_MASTER_NODE": f"{master}:{port}"}
        if loopback:
            extra["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        exported = {**extra, **job.rank_env}
        env = mpirun_env({**os.environ, **exported})
        argv = mpirun_argv(nodes=spec.nodes, procs_per_node=spec.procs_per_node, python=python,
                           command=spec.command, export=sorted(exported), hostfile=hostfile, rsh_agent=rsh_agent,
                           workdir=spec.workdir or os.getcwd(), user_options=spec.mpi_options, mpirun=self.mpirun)
        return argv, env

    def _teardown(self) -> None:
        # mpirun first: it stops the ranks on every host in order; then whatever is left.
        for node in list(self.supervisor.nodes):
            if node.proc.poll() is None:
                try:
                    node.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + self.grace_seconds
                while node.proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
        self.supervisor.teardown()

    def terminate(self) -> None:
        self.supervisor.stop("terminate")
        self._teardown()

    def pids(self) -> set[int]:
        return self.supervisor.pids()
