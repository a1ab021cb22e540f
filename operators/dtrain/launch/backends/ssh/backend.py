"""SSH backend: one torchrun agent per host, started over the ``ssh`` client.

* Hosts come from the ``hostfile``/``hosts`` option (``host slots=N``, optionally
  ``user@host:port``): the first ``nodes`` hosts, node rank = line order, rendezvous on the
  first host. torchrun runs with the *static* rendezvous and ``--node-rank`` so that
  NODE_RANK (and so RANK) follows host order; c10d would order nodes by hostname and pid.
* Every ssh call is an argv list (BatchMode, the key, port, host-key policy), and the
  one string the remote shell sees is built with ``shlex.join``: a hostile argument
  arrives verbatim. The job's environment (it may hold secrets) goes over stdin as one
  JSON line, never in an argv.
* Blocking mode: on each host ``remote_agent`` makes its own session, echoes its pgid, runs
  the agent, and keeps stdin open as a lifeline (EOF: the launcher is gone, stop). On a
  failure, cancel or SIGTERM, a second ssh per host sends ``kill -TERM -- -PGID``, then
  ``kill -KILL`` where the node has not ended within the grace period; then the local ssh
  clients are torn down, which closes every lifeline. No orphan on any host.
* Detached mode (``submit(detached=True)``, deferrable tasks): each host runs
  ``detached_node`` (see :mod:`.detached`), which outlives the ssh session; a poll reads the
  nodes' heartbeats and exit records in the shared run directory and asks over ssh (reusing
  connections) only the hosts whose heartbeat is stale; cancel asks every host. The daemons
  sign their records with a per-job secret (:mod:`dtrain.launch.node.records`) that goes to them over stdin and
  to the watcher in the job handle (``data["secret"]``), never to the ranks.
* Elastic jobs (``nodes="MIN:MAX"``, blocking mode): every host of the hostfile runs an agent, those
  beyond MAX as spares waiting in the rendezvous; the rendezvous store runs on this host
  (:mod:`dtrain.launch.core.rdzv_store`). A lost node (its ssh client ends with 255) ends the job
  only when fewer than MIN nodes are left (:mod:`dtrain.launch.core.elastic`); otherwise the
  survivors re-form the round, and once the lost host's lease has surely lapsed (``lost_after`` plus
  the stop grace) this backend asks its login port every few seconds and starts its agent again
  when it answers: it rejoins at the next round.
* Every ssh action runs at most ``fanout`` ssh clients at once (default 32, like pdsh): the
  blocking start opens the next host's session once an earlier one has announced itself.
* The grace period (SIGTERM to SIGKILL) is the spec's ``stop_grace`` everywhere: in the
  remote agent's and the detached node's ``--grace``, in the agents' environment
  (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, DTRAIN_STOP_GRACE), in the detached handle (for ``stop``)
  and in the launcher's own wait; ``cancel(handle, grace=...)`` may shorten it.

Assumes, like DeepSpeed's and torchrun's multi-node launchers, that the package, the
training script and the interpreter path exist on every host, and that the run directory
is on a filesystem all hosts share (rank exit records, checkpoints and metrics go there).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from dtrain.errors import LaunchError, SpecError
from dtrain.launch.backends.base import SECRET_KEY, Backend, DryRunRequest, JobHandle, JobStatus, NodeAccess
from dtrain.launch.backends.ssh import control
from dtrain.launch.backends.ssh import detached as nodes
from dtrain.launch.backends.ssh.fanout import run_bounded, run_bounded_async
from dtrain.launch.backends.ssh.hostfile import (KEEPALIVE_S, SSH_OPTIONS, HostEntry, SSHPlacement, SSHSettings,
                                                 resolve_options, ssh_argv)
from dtrain.launch.core.elastic import Membership, Rounds
from dtrain.launch.core.job import Job
from dtrain.launch.core.lost import PROBE_TIMEOUT_S, LostNode, fault_of, lost_node
from dtrain.launch.backends.placement import Placement
from dtrain.launch.core.processes import NodeProcess, NodeSupervisor
from dtrain.launch.core.rdzv_store import RendezvousStore, store_address
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.core.torchrun import Elastic, Static, agent_argv
from dtrain.launch.node.lease import LOST_EXIT_CODE
from dtrain.launch.node.net import free_port
from dtrain.launch.node.rdzv_auth import StoreKey

REMOTE_AGENT = "dtrain.launch.backends.ssh.remote_agent"
# The remote agent's announcement, as the supervisor tags it (node index from the ssh client's
# own stream), carrying the job's secret nonce; anything else is rank output.
ANNOUNCE_RE = re.compile(r"\[node(\d+)\] \[dtrain-remote\] nonce=([0-9a-f]{32}) node=(\d+) pgid=(\d+) host=\S+")
PORT_PROBE = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
LOOPBACK_PREFIXES = ("127.", "localhost", "::1")
#: seconds between two looks at a lost host's login port, while an elastic job waits for it to return
REJOIN_PROBE_S = 5.0


def remote_agent_command(python: str, *, job_id: str, node_index: int, pgid_file: str, workdir: str,
                         grace: float, lease: float, agent: Sequence[str]) -> str:
    """The single string the host's login shell runs: every word shlex-quoted."""
    return shlex.join([python, "-m", REMOTE_AGENT, "--job-id", job_id, "--node", str(node_index),
                       "--pgid-file", pgid_file, "--workdir", workdir, "--grace", f"{grace:g}",
                       "--lease", f"{lease:g}", "--", *agent])


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


def ssh_config_text(hosts: Sequence[HostEntry], settings: SSHSettings) -> str:
    """An ssh_config with one ``Host dtrain-nodeN`` alias per host (for mpirun's rsh agent). Values
    were validated (names, ports, paths without blanks), so no line can smuggle another option."""
    blocks = []
    for i, host in enumerate(hosts):
        lines = [f"Host dtrain-node{i}", f"  HostName {host.address}", "  BatchMode yes",
                 f"  StrictHostKeyChecking {settings.strict_host_key_checking}",
                 f"  ConnectTimeout {settings.connect_timeout}",
                 # a host cut off ends mpirun's session to it after lost_after, as it ends ours
                 f"  ServerAliveInterval {KEEPALIVE_S}", f"  ServerAliveCountMax {settings.keepalive_count}",
                 "  LogLevel ERROR"]
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


class SSHNodeSupervisor(NodeSupervisor):
    """NodeSupervisor whose node processes (ssh clients) get one stdin line and keep stdin open.

    The open pipe is the lifeline: when this process dies, even by SIGKILL, the pipe closes,
    ssh forwards EOF, and the remote agent stops its tree.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.started_at: dict[int, float] = {}  # node index -> when its ssh client started
        self._leases_done = threading.Event()

    def start_with_input(self, argvs: Sequence[Sequence[str]], payloads: Sequence[bytes], *, limit: int,
                         connected: Callable[[int], bool], connect_wait: float) -> None:
        """Start one ssh client per host, at most ``limit`` of them still connecting at a time: a
        client counts as connecting until ``connected(index)`` (its agent announced itself) or it
        ends, or for at most ``connect_wait`` seconds."""
        for index, (argv, payload) in enumerate(zip(argvs, payloads)):
            self._wait_for_slot(limit, connected, connect_wait)
            if self._stop.is_set():
                return
            self.start_node(index, argv, payload)

    def start_node(self, index: int, argv: Sequence[str], payload: bytes) -> None:
        """Start node ``index``'s ssh client (again, for a node that comes back to an elastic job)."""
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.stdin.write(payload)
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # ssh already failed: its exit status and output report it
        node = NodeProcess(index=index, argv=list(argv), proc=proc)
        node.reader = threading.Thread(target=self._pump, args=(node,), daemon=True)
        node.reader.start()
        with self._lock:
            self.nodes.append(node)
            self.started_at[index] = time.monotonic()

    def lost_connection(self) -> NodeProcess | None:
        """The first node whose ssh client ended with ssh's own failure (255: the connection or the
        host went away), if any."""
        return next((n for n in list(self.nodes) if n.proc.poll() == LOST_EXIT_CODE), None)

    def _wait_for_slot(self, limit: int, connected: Callable[[int], bool], connect_wait: float) -> None:
        def connecting() -> int:
            now = time.monotonic()
            return sum(1 for n in list(self.nodes) if n.proc.poll() is None and not connected(n.index)
                       and now - self.started_at[n.index] < connect_wait)

        while connecting() >= limit and not self._stop.is_set():
            time.sleep(0.02)

    def close_lifelines(self) -> None:
        self._leases_done.set()
        for node in list(self.nodes):
            try:
                node.proc.stdin.close()
            except (OSError, AttributeError):
                pass

    def renew_leases(self, every: float) -> None:
        """Start renewing every node's lease (remote_agent ``--lease``): a newline down each lifeline
        every ``every`` seconds, until :meth:`close_lifelines`. A node that stops receiving them (cut
        off, or this host gone without closing the connections) fences itself."""
        def renew() -> None:
            while not self._leases_done.wait(every):
                for node in list(self.nodes):
                    try:
                        node.proc.stdin.write(b"\n")
                        node.proc.stdin.flush()
                    except (OSError, ValueError, AttributeError):
                        continue  # that node's ssh ended (its exit status reports it) or the lifeline was closed

        threading.Thread(target=renew, name="dtrain-ssh-leases", daemon=True).start()


class SSHBackend(Backend):
    """One torchrun agent per host over ssh; deferrable through detached nodes."""

    name = "ssh"
    description = "one torchrun agent per host, started over OpenSSH"
    install_hint = "apt-get install openssh-client"
    options = SSH_OPTIONS  # its backend_options, declared once (flags, checks, docs/backends.md)
    option_names = SSH_OPTIONS.names
    supports_detached = True
    supports_elastic = True
    cli_module = "dtrain.launch.backends.ssh.cli"
    carries_secret_env = True  # each session's stdin (node_env), never the remote command line

    def __init__(self, sink=None, grace_seconds: float | None = None):
        super().__init__(**({"sink": sink} if sink else {}))
        #: seconds between SIGTERM and SIGKILL on a stop; None: the spec's stop_grace
        self.grace_seconds = grace_seconds
        self._grace_now = 5.0 if grace_seconds is None else grace_seconds  # the submitted job's
        self.nonce = secrets.token_hex(16)  # known to this launcher and the agents only
        self.secret = secrets.token_hex(32)  # a detached job's: keys its daemons' records (dtrain.launch.node.records)
        self.supervisor = SSHNodeSupervisor(self._watch_sink, grace_seconds=self._grace_now)
        self.pgids: dict[int, int] = {}
        self.announced_at: dict[int, float] = {}  # node index -> when its agent announced itself
        self.hosts: list[HostEntry] = []
        self.settings = SSHSettings()
        self._targets: dict[tuple[str, str, str], nodes.Target] = {}  # detached jobs' nodes: (job id, run dir, secret)
        self._teardown_lock = threading.Lock()
        self._torn_down = False
        self._over = threading.Event()  # set by the teardown: what waits on the job stops waiting
        self.store: RendezvousStore | None = None  # an elastic job's (below: its bookkeeping)
        self.membership: Membership | None = None
        self.rounds: Rounds | None = None
        self._request: DryRunRequest | None = None

    # -- options --------------------------------------------------------------------------------

    @classmethod
    def runner(cls, distribution: str) -> str:
        return "mpi" if distribution == "mpi" else cls.name  # mpirun reaches the hosts itself

    @classmethod
    def resolve_placement(cls, placement: Placement) -> SSHPlacement:
        cls.check_option_names(placement.options)
        if "conn_id" in placement.options:
            raise SpecError("backend_options['ssh'].conn_id", placement.options["conn_id"],
                            "an Airflow connection is read by the operators; give hostfile or hosts here")
        if shutil.which("ssh") is None:
            raise SpecError("backend", cls.name, f"the OpenSSH client 'ssh' on PATH ({cls.install_hint})")
        return resolve_options(placement.options, placement.nodes, placement.procs_per_node, spares=placement.elastic)

    @classmethod
    def resolve_operator_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        from dtrain.launch.backends.ssh.connection import resolve_connection

        return resolve_connection(options)

    @staticmethod
    def _settings(spec: LaunchSpec | Placement) -> SSHSettings:
        return spec.resolved.settings

    @classmethod
    def node_commands(cls, placement: Placement, python_args: Sequence[str]) -> list[tuple[str, list[str]]]:
        settings = cls._settings(placement)
        python = settings.python or sys.executable
        remote = shlex.join([python, *python_args])
        return [(host.address, ssh_argv(settings, host, remote)) for host in placement.resolved.hosts]

    @classmethod
    def node_fanout(cls, placement: Placement) -> int:
        return cls._settings(placement).fanout

    @classmethod
    def node_access(cls, placement: Placement) -> NodeAccess:
        settings = cls._settings(placement)
        hosts = placement.resolved.hosts
        return NodeAccess(addresses=tuple(h.address for h in hosts), python=settings.python or sys.executable,
                          ssh_config=ssh_config_text(hosts, settings), loopback=cls.on_this_host(placement),
                          endpoints=tuple((h.address, settings.login_port(h)) for h in hosts),
                          lost_after=settings.lost_after)

    @classmethod
    def on_this_host(cls, placement: Placement) -> bool:
        return all(is_loopback(h.address) for h in placement.resolved.hosts)

    def free_port(self, spec: LaunchSpec) -> int:
        settings = self._settings(spec)
        return spec.rdzv_port or probe_port(settings, spec.resolved.hosts[0], settings.python or sys.executable)

    # -- lifecycle ------------------------------------------------------------------------------

    def dryrun(self, job: Job, *, detached: bool = False) -> DryRunRequest:
        spec = job.spec
        hosts, settings = list(spec.resolved.hosts), self._settings(spec)
        python = settings.python or sys.executable
        if spec.elastic and detached:
            raise SpecError("deferrable", True, "False for an elastic job (nodes=MIN:MAX): its rendezvous store "
                                                "lives with the launcher")
        # an elastic job's store runs here, at our address on the nodes' route; a fixed job's on node 0
        server = store_address(hosts[0].address) if spec.elastic else hosts[0].address
        port = (spec.rdzv_port or free_port("0.0.0.0")) if spec.elastic else self.free_port(spec)
        workdir = spec.workdir or os.getcwd()
        grace = self.stop_grace(spec)
        common = self.node_env(job, port=port)  # once: it looks at every host (thousands, at scale)
        argvs, payloads = [], []
        for i, host in enumerate(hosts):
            rdzv = Elastic(server, port, host.address) if spec.elastic else Static(endpoint=(server, port), node_rank=i)
            agent = agent_argv(spec, python=python, job_id=job.job_id, rdzv=rdzv)
            if detached:
                command = nodes.node_command(python, "start", job.run_dir, i, "--job-id", job.job_id,
                                             "--workdir", workdir, "--grace", f"{grace:g}",
                                             *nodes.lease_options(hosts, i, settings), "--", *agent)
            else:
                command = remote_agent_command(python, job_id=job.job_id, node_index=i,
                                               pgid_file=os.path.join(job.run_dir, "remote", f"node{i}.pgid"),
                                               workdir=workdir, grace=grace, lease=settings.lost_after, agent=agent)
            argvs.append(tuple(ssh_argv(settings, host, command)))
            # a detached daemon's records, an elastic agent's rendezvous: signed with the job's secret
            secret = {"secret": self.secret} if detached else {"nonce": self.nonce}
            if spec.elastic:
                secret["secret"] = self.secret
            payloads.append(json.dumps({"env": dict(common, DTRAIN_NODE_INDEX=str(i)), **secret}) + "\n")
        return DryRunRequest(backend=self.name, argvs=tuple(argvs), stdin=tuple(payloads),
                             env={"MASTER_ADDR": server, "MASTER_PORT": str(port)})

    def submit(self, job: Job, *, detached: bool = False) -> JobHandle:
        request = self.dryrun(job, detached=detached)
        self.hosts, self.settings = list(job.spec.resolved.hosts), self._settings(job.spec)
        self._grace_now = self.supervisor.grace_seconds = self.stop_grace(job.spec)
        handle = JobHandle(backend=self.name, job_id=job.job_id, backend_job_id=job.job_id, run_dir=job.run_dir,
                           world_size=job.spec.world_size, submitted_at=time.time(),
                           data={"hosts": [str(h) for h in self.hosts], "ssh": self.settings.to_dict(),
                                 "detached": detached, "poll_interval": self.settings.poll_interval,
                                 "max_poll_interval": self.settings.max_poll_interval,
                                 "stop_grace": self._grace_now, **({SECRET_KEY: self.secret} if detached else {})})
        rendezvous = f"{request.env['MASTER_ADDR']}:{request.env['MASTER_PORT']}"
        names = ", ".join(h.host for h in self.hosts)
        if detached:
            nodes.start(self._target(handle), job.run_dir, request.argvs, request.stdin)
            self.sink(f"[dtrain] ssh (detached): {len(self.hosts)} host(s) {names}; rendezvous {rendezvous}; "
                      f"logs in {os.path.join(job.run_dir, 'detached')}")
        else:
            if job.spec.elastic:
                self._start_elastic(job, request)
            self.sink(f"[dtrain] ssh: {len(self.hosts)} host(s) {names}; rendezvous {rendezvous}")
            self.supervisor.renew_leases(KEEPALIVE_S)
            self.supervisor.start_with_input(request.argvs, [p.encode() for p in request.stdin],
                                             limit=self.settings.fanout, connected=self.pgids.__contains__,
                                             connect_wait=self.settings.connect_timeout + 30)
        return handle

    def _start_elastic(self, job: Job, request: DryRunRequest) -> None:
        spec = job.spec
        self._request = request
        self.membership = Membership(spec.placement.min_nodes, self.sink)
        self.rounds = Rounds(job.run_dir, spec.placement.procs_per_node, [h.host for h in self.hosts], self.sink,
                             StoreKey(self.secret), on_round=self.on_round)
        self.store = RendezvousStore(sink=self.sink)
        self.store.start(request.env["MASTER_ADDR"], int(request.env["MASTER_PORT"]), self.secret)
        spares = len(self.hosts) - spec.placement.nodes
        self.sink(f"[dtrain] elastic: {spec.placement.nnodes} nodes" + (f", {spares} spare host(s)" if spares else "")
                  + f"; rendezvous store on this host ({request.env['MASTER_ADDR']}:{self.store.port})")

    def _poll_elastic(self) -> JobStatus:
        running = self.membership.scan(self.supervisor.latest(), self._lost_of)
        return self.membership.status(running) or JobStatus(state="RUNNING", done=False)

    def _lost_of(self, node: NodeProcess, code: int) -> LostNode | None:
        """The verdict on a node of an elastic job whose ssh client ended with ssh's own failure; the
        host is then watched for its return."""
        if code != LOST_EXIT_CODE or self._stop.is_set():
            return None
        host = self.hosts[node.index]
        self.store.lost(node.index)  # the survivors re-form the round now, not when its keep-alive lapses
        verdict = lost_node(node.index, host.address, self.settings.login_port(host),
                            timeout=min(PROBE_TIMEOUT_S, self.settings.connect_timeout))
        threading.Thread(target=self._bring_back, args=(node.index,), name=f"dtrain-rejoin-{node.index}",
                         daemon=True).start()
        return verdict

    def _bring_back(self, index: int) -> None:
        """Start node ``index``'s agent again once its host answers: not before its lease has surely
        lapsed (the node then has stopped what it ran), then a look at its login port every
        :data:`REJOIN_PROBE_S` seconds, until the job ends."""
        host, port = self.hosts[index], self.settings.login_port(self.hosts[index])
        if self._over.wait(self.settings.lost_after + self._grace_now):
            return
        while not self._over.is_set():
            if fault_of(host.address, port, min(PROBE_TIMEOUT_S, self.settings.connect_timeout)) is None:
                with self._teardown_lock:  # never a node started under a teardown
                    if self._torn_down:
                        return
                    self.pgids.pop(index, None)
                    self.membership.returned(index)
                    self.store.back(index)
                    self.sink(f"[dtrain] node {index} ({host.address}) answers again: it rejoins at the next round")
                    self.supervisor.start_node(index, self._request.argvs[index], self._request.stdin[index].encode())
                return
            self._over.wait(REJOIN_PROBE_S)

    def _target(self, handle: JobHandle) -> nodes.Target:
        """The detached job's nodes, parsed from the handle once per job and backend (not per poll)."""
        secret = str(handle.data.get(SECRET_KEY, ""))  # a handle rebuilt from an event has none
        key = (handle.job_id, handle.run_dir, secret)
        if key not in self._targets:
            self._targets[key] = nodes.Target.of_handle(handle.data["hosts"], handle.data["ssh"], handle.job_id, secret)
        return self._targets[key]

    def poll(self, handle: JobHandle) -> JobStatus:
        if handle.data.get("detached"):
            return nodes.query_job(self._target(handle), handle.run_dir, self.sink)
        if self.membership is not None:
            return self._poll_elastic()
        done, code, node = self.supervisor.check(expected=len(handle.data["hosts"]))
        if not done:
            return JobStatus(state="RUNNING", done=False)
        lost = self.supervisor.lost_connection() if code != 0 else None
        if lost is not None:  # before the peers it left behind, whose failures it caused
            node, code = lost, LOST_EXIT_CODE
            host = self.hosts[node.index]
            self.sink(f"[dtrain] ssh to {host.host} failed (exit {LOST_EXIT_CODE}): see its lines above")
            verdict = lost_node(node.index, host.address, self.settings.login_port(host),
                                timeout=min(PROBE_TIMEOUT_S, self.settings.connect_timeout))
            self.sink(f"[dtrain] {verdict.message()}: its ranks fence themselves within "
                      f"{self.settings.lost_after:g} s of losing the launcher; stopping the other nodes")
            return JobStatus(state="LOST", done=True, exit_code=code, failed_node=node.index,
                             reason=verdict.message(), tail=list(node.tail), lost=verdict.to_dict())
        return JobStatus(state="COMPLETED" if code == 0 else "FAILED", done=True, exit_code=code,
                         failed_node=None if node is None else node.index, tail=[] if node is None else list(node.tail))

    async def async_poll(self, handle: JobHandle) -> JobStatus:
        if not handle.data.get("detached"):
            return self.poll(handle)
        target, mux_dir = self._target(handle), self._mux_dir(handle)
        status, asked = await nodes.async_query_job(target, handle.run_dir, mux_dir, self.sink)
        if asked:
            self.sink(f"[dtrain] heartbeat stale for node(s) {', '.join(map(str, asked))}: asked over ssh")
        if status.done:
            await self._close_masters(target, mux_dir)
        return status

    @staticmethod
    def _mux_dir(handle: JobHandle) -> str:
        return control.control_dir(f"{handle.job_id}\0{handle.run_dir}", create=False)

    async def _close_masters(self, target: nodes.Target, mux_dir: str) -> None:
        """End the job's ssh master connections on this host (they would idle out after ControlPersist)."""
        await run_bounded_async(nodes.close_argvs(target, mux_dir), limit=target.settings.fanout, timeout=10)
        await control.wait_closed(mux_dir)  # else the directory, not yet empty, would be left behind
        control.remove_dir(mux_dir)

    @staticmethod
    def _handle_grace(handle: JobHandle, grace: float | None) -> float:
        """``grace`` if given, else the one the job was started with (a handle from before the
        field existed: the nodes' old default)."""
        if grace is not None:
            return float(grace)
        return float(handle.data.get("stop_grace", nodes.DEFAULT_GRACE))

    def cancel(self, handle: JobHandle, grace: float | None = None) -> None:
        """Stop every node: SIGTERM, SIGKILL after ``grace`` seconds (default: the spec's stop_grace)
        where a node still runs."""
        if handle.data.get("detached"):
            nodes.stop_job(self._target(handle), handle.run_dir, self._handle_grace(handle, grace), self.sink)
        else:
            self._teardown(grace)

    async def async_cancel(self, handle: JobHandle, grace: float | None = None) -> None:
        if not handle.data.get("detached"):
            import asyncio

            return await asyncio.to_thread(self.cancel, handle, grace)
        target, grace, mux_dir = self._target(handle), self._handle_grace(handle, grace), self._mux_dir(handle)
        await nodes.async_stop_job(target, handle.run_dir, grace, mux_dir, self.sink)
        await self._close_masters(target, mux_dir)

    def logs(self, handle: JobHandle, lines: int = 40) -> list[str]:
        if handle.data.get("detached"):
            return nodes.read_logs(handle.run_dir, len(handle.data["hosts"]), lines)
        return [line for node in list(self.supervisor.nodes) for line in node.tail][-lines:]

    def release(self, handle: JobHandle) -> None:
        if not handle.data.get("detached"):
            self._teardown()  # closes the lifelines and joins the reader threads
            if self.store is not None:
                self.store.stop()  # after the agents: they close the rendezvous in it

    # -- blocking-mode teardown -----------------------------------------------------------------

    def _watch_sink(self, line: str) -> None:
        match = ANNOUNCE_RE.fullmatch(line)
        if match and self._trusted(*match.groups()):
            self.pgids[int(match.group(1))] = int(match.group(4))
            self.announced_at[int(match.group(1))] = time.monotonic()
            return  # the nonce stays out of the logs
        if self.rounds is not None and self.rounds.feed(line):
            return
        self.sink(line)

    def _trusted(self, stream: str, nonce: str, node: str, pgid: str) -> bool:
        """Only the agent knows the nonce; its node must be the stream's; the group id must be a
        real one (never 0 or 1: ``kill -- -1`` signals everything); first announcement wins."""
        return (secrets.compare_digest(nonce, self.nonce) and stream == node and int(pgid) > 1
                and int(stream) not in self.pgids)

    def _remote_signal(self, signal_name: str, indexes: Sequence[int]) -> None:
        """``kill -SIG -- -PGID`` on each host, over ssh, ``fanout`` at a time (best effort: the lifeline backs it)."""
        chosen = [i for i in indexes if i in self.pgids]
        argvs = [ssh_argv(self.settings, self.hosts[i], shlex.join(["kill", f"-{signal_name}", "--", f"-{self.pgids[i]}"]))
                 for i in chosen]
        run_bounded(argvs, limit=self.settings.fanout, timeout=self.settings.connect_timeout + 10)

    def _running_nodes(self) -> list[int]:
        return [n.index for n in list(self.supervisor.nodes) if n.proc.poll() is None]

    def _teardown(self, grace: float | None = None) -> None:
        grace = self._grace_now if grace is None else grace
        with self._teardown_lock:
            if self._torn_down:
                return
            self._torn_down = True
            self._over.set()
            running = self._running_nodes()
            if running:
                # A node's ssh client still running means its remote agent (or something holding
                # its output) is alive: ask every such host to stop its process group. The wait
                # ends when every node has ended (its ranks saved and exited), at most the grace.
                self._wait_announced(running, timeout=2.0)
                self._remote_signal("TERM", running)
                deadline = time.monotonic() + grace + 1.0
                while self._running_nodes() and time.monotonic() < deadline:
                    time.sleep(0.1)
                still = self._running_nodes()
                if still:
                    self._remote_signal("KILL", still)
            self.supervisor.close_lifelines()
            self.supervisor.teardown(min(grace, 5.0))  # the local ssh clients: the hosts are stopped by now

    def _wait_announced(self, indexes: Sequence[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(i not in self.pgids for i in indexes) and time.monotonic() < deadline:
            time.sleep(0.05)

    def terminate(self, grace: float | None = None) -> None:
        # May run in a signal handler on the thread blocked in run(): do the work in a thread,
        # so no lock that thread holds is awaited here; run()'s own teardown waits for it.
        super().terminate()
        self.supervisor.stop("terminate")
        worker = threading.Thread(target=self._teardown, args=(grace,), daemon=True)
        worker.start()
        worker.join(timeout=(self._grace_now if grace is None else grace) + 15)

    def pids(self) -> set[int]:
        return self.supervisor.pids()


__all__ = ["SSHBackend", "ssh_argv", "remote_agent_command", "probe_port", "ssh_config_text", "is_loopback"]
