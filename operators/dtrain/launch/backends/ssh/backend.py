"""SSH backend: one torchrun agent per host, started over the ``ssh`` client.

* Hosts come from the spec's hostfile (``host slots=N``, optionally ``user@host:port``):
  the first ``nodes`` hosts, node rank = line order, rendezvous on the first host.
  torchrun runs with the *static* rendezvous and ``--node-rank`` so that NODE_RANK
  (and so RANK) follows host order; c10d would order nodes by hostname and pid.
* Every ssh call is an argv list (BatchMode, the key, port, host-key policy), and the
  one string the remote shell sees is built with ``shlex.join``: a hostile argument
  arrives verbatim. The job's environment (it may hold secrets) goes over stdin as one
  JSON line, never in an argv.
* On each host ``operators.launch.remote_agent`` makes its own session, echoes its pgid,
  runs the agent, and keeps stdin open as a lifeline (EOF: the launcher is gone, stop).
* On a failure, terminate() or SIGTERM, a second ssh per host sends ``kill -TERM -- -PGID``,
  then ``kill -KILL`` where the node has not ended within the grace period; then the local
  ssh clients are torn down, which closes every lifeline. No orphan on any host.

Assumes, like DeepSpeed's and torchrun's multi-node launchers, that the package, the
training script and the interpreter path exist on every host, and that the run directory
is on a filesystem all hosts share (rank exit records, checkpoints and metrics go there).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from typing import Sequence

from operators.errors import LaunchError
from operators.launch.backends.base import Backend, BackendOutcome
from operators.launch.hostfile import HostEntry, SSHSettings
from operators.launch.job import Job
from operators.launch.processes import NodeProcess, NodeSupervisor
from operators.launch.spec import LaunchSpec
from operators.launch.torchrun import agent_argv

SSH = "ssh"
ANNOUNCE_RE = re.compile(r"\[dtrain-remote\] node=(\d+) pgid=(\d+)")
PORT_PROBE = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
LOOPBACK_PREFIXES = ("127.", "localhost", "::1")


def ssh_argv(settings: SSHSettings, host: HostEntry, remote_command: str) -> list[str]:
    """``ssh [options] -- HOST 'remote command'``; per-host user/port win over the settings'."""
    argv = [SSH, "-T", "-o", "BatchMode=yes", "-o", f"StrictHostKeyChecking={settings.strict_host_key_checking}",
            "-o", f"ConnectTimeout={settings.connect_timeout}",
            "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4", "-o", "LogLevel=ERROR"]
    if settings.known_hosts_file:
        argv += ["-o", f"UserKnownHostsFile={settings.known_hosts_file}"]
    if settings.key_file:
        argv += ["-i", settings.key_file, "-o", "IdentitiesOnly=yes"]
    port = host.port or settings.port
    if port:
        argv += ["-p", str(port)]
    user = host.user or settings.user
    if user:
        argv += ["-l", user]
    return argv + ["--", host.address, remote_command]


def static_agent_argv(spec: LaunchSpec, *, python: str, node_index: int, rdzv_host: str, rdzv_port: int,
                      job_id: str) -> list[str]:
    """torchrun for one host with the static rendezvous: ``--node-rank`` fixes the node order.

    Rendered from ``torchrun.agent_argv`` (one source for the shared flags) with its c10d
    rendezvous options swapped; fails loudly should those options ever change shape.
    """
    base = agent_argv(spec, python=python, node_index=node_index, rdzv_host=rdzv_host, rdzv_port=rdzv_port,
                      job_id=job_id)
    split = base.index("--no-python")
    head, tail = base[:split], base[split:]
    out: list[str] = []
    swapped = set()
    for item in head:
        if item.startswith("--rdzv-backend="):
            out.append("--rdzv-backend=static")
            swapped.add("backend")
        elif item.startswith("--rdzv-conf="):
            out += [f"--rdzv-conf=timeout={int(spec.rdzv_timeout)}", f"--node-rank={node_index}"]
            swapped.add("conf")
        else:
            out.append(item)
    if swapped != {"backend", "conf"}:
        raise LaunchError(f"torchrun.agent_argv changed shape; cannot derive the static rendezvous from {base}", 2)
    return out + tail


def remote_agent_command(python: str, *, job_id: str, node_index: int, pgid_file: str, workdir: str,
                         grace: float, agent: Sequence[str]) -> str:
    """The single string the host's login shell runs: every word shlex-quoted."""
    return shlex.join([python, "-m", "operators.launch.remote_agent", "--job-id", job_id, "--node", str(node_index),
                       "--pgid-file", pgid_file, "--workdir", workdir, "--grace", f"{grace:g}", "--", *agent])


def is_loopback(address: str) -> bool:
    return address.startswith(LOOPBACK_PREFIXES)


def probe_port(settings: SSHSettings, host: HostEntry, python: str) -> int:
    """A port free on ``host`` right now (for the rendezvous there), asked over ssh."""
    argv = ssh_argv(settings, host, shlex.join([python, "-c", PORT_PROBE]))
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=settings.connect_timeout + 30)
    except subprocess.TimeoutExpired as e:
        raise LaunchError(f"ssh to {host.host} timed out while probing a rendezvous port", 255) from e
    text = done.stdout.strip()
    if done.returncode != 0 or not text.isdigit():
        raise LaunchError(f"ssh to {host.host} failed (exit {done.returncode}) while probing a rendezvous port: "
                          f"{done.stderr.strip()[-500:]}", done.returncode or 255)
    return int(text)


class SSHNodeSupervisor(NodeSupervisor):
    """NodeSupervisor whose node processes (ssh clients) get one stdin line and keep stdin open.

    The open pipe is the lifeline: when this process dies, even by SIGKILL, the pipe closes,
    ssh forwards EOF, and the remote agent stops its tree.
    """

    def start_with_input(self, argvs: Sequence[Sequence[str]], envs, payloads: Sequence[bytes],
                         cwd: str | None = None) -> None:
        for index, (argv, env, payload) in enumerate(zip(argvs, envs, payloads)):
            if self._stop.is_set():
                return
            proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.stdin.write(payload)
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # ssh already failed: wait() reports its exit status and output
            node = NodeProcess(index=index, argv=list(argv), proc=proc)
            node.reader = threading.Thread(target=self._pump, args=(node,), daemon=True)
            node.reader.start()
            with self._lock:
                self.nodes.append(node)

    def close_lifelines(self) -> None:
        for node in list(self.nodes):
            try:
                node.proc.stdin.close()
            except (OSError, AttributeError):
                pass


class SSHBackend(Backend):
    name = "ssh"

    def __init__(self, sink=None, grace_seconds: float = 5.0):
        super().__init__(**({"sink": sink} if sink else {}))
        self.grace_seconds = grace_seconds
        self.supervisor = SSHNodeSupervisor(self._watch_sink, grace_seconds=grace_seconds)
        self.pgids: dict[int, int] = {}
        self.hosts: list[HostEntry] = []
        self.settings = SSHSettings()
        self._teardown_lock = threading.Lock()
        self._torn_down = False

    def _watch_sink(self, line: str) -> None:
        match = ANNOUNCE_RE.search(line)
        if match:
            self.pgids[int(match.group(1))] = int(match.group(2))
        self.sink(line)

    def run(self, job: Job) -> BackendOutcome:
        spec = job.spec
        self.hosts = list(spec.resolved_hosts)
        self.settings = SSHSettings.from_mapping(spec.ssh)
        python = self.settings.python or sys.executable
        first = self.hosts[0]
        try:
            port = spec.rdzv_port or probe_port(self.settings, first, python)
        except LaunchError as e:
            self.sink(f"[dtrain] {e}")
            return BackendOutcome(exit_code=e.exit_code, node_index=0, tail=[str(e)])
        workdir = spec.workdir or os.getcwd()
        argvs, payloads = [], []
        for i, host in enumerate(self.hosts):
            agent = static_agent_argv(spec, python=python, node_index=i, rdzv_host=first.address, rdzv_port=port,
                                      job_id=job.job_id)
            command = remote_agent_command(python, job_id=job.job_id, node_index=i,
                                           pgid_file=os.path.join(job.run_dir, "remote", f"node{i}.pgid"),
                                           workdir=workdir, grace=self.grace_seconds, agent=agent)
            argvs.append(ssh_argv(self.settings, host, command))
            payloads.append((json.dumps({"env": self.node_env(job, i, port)}) + "\n").encode())
        self.sink(f"[dtrain] ssh: {len(self.hosts)} host(s) "
                  f"{', '.join(h.host for h in self.hosts)}; rendezvous {first.address}:{port}")
        try:
            self.supervisor.start_with_input(argvs, [os.environ] * len(argvs), payloads)
            code, node = self.supervisor.wait(expected=len(argvs))
        finally:
            self._teardown()
        if code == -1:
            return BackendOutcome(exit_code=-1, stopped=True)
        if node is not None and code == 255:
            self.sink(f"[dtrain] ssh to {self.hosts[node.index].host} failed (exit 255): see its lines above")
        return BackendOutcome(exit_code=code, node_index=None if node is None else node.index,
                              tail=[] if node is None else list(node.tail))

    def node_env(self, job: Job, index: int, port: int) -> dict[str, str]:
        """What node ``index``'s agent adds to the host's own environment (sent over stdin)."""
        spec = job.spec
        env: dict[str, str] = {}
        if all(is_loopback(h.address) for h in self.hosts):
            env["GLOO_SOCKET_IFNAME"] = "lo"  # "hosts" on this machine talk over loopback
        if spec.distribution == "tensorflow":
            from operators.launch.tf_config import backend_env

            env.update(backend_env([h.address for h in self.hosts], port + 1, spec.parameter_servers))
        env.update(job.rank_env)
        env["DTRAIN_NODE_INDEX"] = str(index)
        return env

    # -- teardown -----------------------------------------------------------------------------

    def _remote_signal(self, signal_name: str, indexes: Sequence[int]) -> None:
        """``kill -SIG -- -PGID`` on each host, over ssh, in parallel (best effort: the lifeline backs it)."""
        def one(i: int) -> None:
            command = shlex.join(["kill", f"-{signal_name}", "--", f"-{self.pgids[i]}"])
            try:
                subprocess.run(ssh_argv(self.settings, self.hosts[i], command), stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=self.settings.connect_timeout + 10)
            except (subprocess.TimeoutExpired, OSError):
                pass

        threads = [threading.Thread(target=one, args=(i,)) for i in indexes if i in self.pgids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _running_nodes(self) -> list[int]:
        return [n.index for n in list(self.supervisor.nodes) if n.proc.poll() is None]

    def _teardown(self) -> None:
        with self._teardown_lock:
            if self._torn_down:
                return
            self._torn_down = True
            running = self._running_nodes()
            if running:
                # A node's ssh client still running means its remote agent (or something holding
                # its output) is alive: ask every such host to stop its process group.
                self._wait_announced(running, timeout=2.0)
                self._remote_signal("TERM", running)
                deadline = time.monotonic() + self.grace_seconds + 1.0
                while self._running_nodes() and time.monotonic() < deadline:
                    time.sleep(0.1)
                still = self._running_nodes()
                if still:
                    self._remote_signal("KILL", still)
            self.supervisor.close_lifelines()
            self.supervisor.teardown()

    def _wait_announced(self, indexes: Sequence[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(i not in self.pgids for i in indexes) and time.monotonic() < deadline:
            time.sleep(0.05)

    def terminate(self) -> None:
        # May run in a signal handler on the thread blocked in run(): do the work in a thread,
        # so no lock that thread holds is awaited here; run()'s own teardown waits for it.
        self.supervisor.stop("terminate")
        worker = threading.Thread(target=self._teardown, daemon=True)
        worker.start()
        worker.join(timeout=self.grace_seconds + 15)

    def pids(self) -> set[int]:
        return self.supervisor.pids()
