"""The backend contract (TorchX's scheduler shape): one class owns a job's whole lifecycle.

A backend is one folder under ``dtrain/launch/backends/`` (or a third-party package
registered through the ``dtrain.backends`` entry-point group) holding a :class:`Backend`
subclass. Nothing outside that folder knows the backend's name or options:

* validation: :meth:`Backend.resolve_placement` checks the backend's options when the registry
  resolves a :class:`~dtrain.launch.backends.placement.Placement` and returns what it resolved from them,
  typed, kept as ``placement.resolved`` (``spec.resolved``; read from there on, the options
  themselves stay as given); :meth:`Backend.validate` checks the rest of a job before anything starts;
* node access: :meth:`Backend.node_access`, :meth:`Backend.node_commands`, :meth:`Backend.node_fanout`
  and :meth:`Backend.on_this_host` take the placement alone (preflight and autotuning have no job);
* the node environment: :meth:`Backend.node_env` is what every node's processes get, the same
  on every backend (a backend adds only its extras); a distribution not in ``distributions`` is
  refused before anything starts;
* :meth:`Backend.dryrun` -> a :class:`DryRunRequest` whose rendered argv/script is exactly what
  :meth:`Backend.submit` would run (no side effects: tests compare it exactly);
* :meth:`Backend.submit` -> a :class:`JobHandle` of primitives (``to_dict``/``from_dict``), so a
  trigger can rebuild it after a restart; ``detached=True`` asks for a job that outlives this
  process (deferrable mode), which only backends with ``supports_detached`` provide;
* :meth:`Backend.poll` / :meth:`Backend.async_poll` -> a :class:`JobStatus`; :meth:`Backend.cancel`
  stops every process of the job on every host; :meth:`Backend.logs` gives its last lines;
* :meth:`Backend.run` (submit, follow, teardown) is built on them.

Backends also contribute their own ``dtrain launch`` options (:meth:`add_cli_arguments`,
:meth:`options_from_cli`) and operator options (``backend_options`` of the operator, resolved
by :meth:`resolve_operator_options`, e.g. an Airflow connection).
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import hashlib
import importlib
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

from dtrain.errors import DTrainError, SpecError
from dtrain.launch.node.lease import LOST_EXIT_CODE
from dtrain.launch.node.net import free_port

if TYPE_CHECKING:  # imported for annotations only: the spec imports the registry
    from dtrain.launch.core.job import Job
    from dtrain.launch.core.lost import LostNode
    from dtrain.launch.backends.placement import Placement
    from dtrain.launch.core.spec import LaunchSpec

Primitive = (str, int, float, bool, type(None))
#: the key of a job handle's ``data`` that holds a per-job secret (see JobHandle.public)
SECRET_KEY = "secret"
# Consecutive polls that could not reach the backend before a job is given up (and cancelled).
MAX_POLL_ERRORS = 5

#: where a job's output goes, one whole line at a time (a backend's ``sink``; node supervision's too)
LineSink = Callable[[str], None]


_STDOUT_LOCK = threading.Lock()


def print_sink(line: str) -> None:
    """Write one whole line to stdout. Every node has its own reader thread, and ``print`` writes
    the text and the newline separately: without one locked write per line, two ranks' lines glue."""
    with _STDOUT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


#: seconds ranks get after SIGTERM when none of them can reach a checkpoint: a hung job's (their stacks
#: are on disk), and the reachable ranks of a job that lost a node (every collective, the checkpoint's
#: agreement too, waits on the lost node's ranks). ``stop_grace`` is for ranks that can save; this is
#: enough to finish a file write already under way.
STUCK_GRACE_S = 5.0


def stop_grace_env(grace: float) -> dict[str, str]:
    """What a node's torchrun agent and its ranks get so that a stop gives each rank ``grace``
    seconds. On SIGTERM the agent forwards it to its workers and SIGKILLs them after
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT whole seconds (read since pytorch/pytorch#172596, 2026; torch
    2.13 here; older torchrun waits a fixed 30 s). The ranks read ``DTRAIN_STOP_GRACE``
    (:mod:`dtrain.training.preemption`)."""
    import math

    return {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(math.ceil(grace)), "DTRAIN_STOP_GRACE": f"{grace:g}"}


def check_primitive(name: str, value: Any) -> Any:
    """``value`` if it is JSON-like primitives only (what a trigger may serialize), else raise."""
    if isinstance(value, Primitive):
        return value
    if isinstance(value, (list, tuple)):
        return [check_primitive(name, v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): check_primitive(name, v) for k, v in value.items()}
    raise DTrainError(f"{name} holds a {type(value).__name__}; a job handle carries primitives only")


@dataclass(frozen=True)
class JobHandle:
    """Where a submitted job is: enough to poll, cancel and read it from any process.

    Args:
        backend: the registered backend name.
        job_id: dtrain's job id (rendezvous id, run name).
        backend_job_id: the backend's own id (a Slurm job id; the job id for ssh).
        run_dir: the job's run directory (exit records, checkpoints, metrics).
        world_size: ranks in the job.
        submitted_at: wall-clock time of the submission.
        data: backend-specific primitives (hosts, SSH settings, poll interval...). ``data["secret"]``,
            if a backend sets it, is a per-job secret the ranks must never see: :meth:`public`
            replaces it by its SHA-256 wherever the handle is written, logged or sent in an event.
    """

    backend: str
    job_id: str
    backend_job_id: str
    run_dir: str
    world_size: int
    submitted_at: float
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return check_primitive("handle", dataclasses.asdict(self) | {"data": dict(self.data)})

    def __repr__(self) -> str:  # a handle in a message or a traceback: never with the secret
        return f"JobHandle({self.public()!r})"

    def public(self) -> dict[str, Any]:
        """:meth:`to_dict` with the secret replaced by its SHA-256: what may go into the run
        directory (the ranks read it), a log or a trigger event; still names one job exactly."""
        data = dict(self.data)
        if SECRET_KEY in data:
            data[SECRET_KEY + "_sha256"] = hashlib.sha256(str(data.pop(SECRET_KEY)).encode()).hexdigest()
        return self.to_dict() | {"data": data}

    @classmethod
    def from_dict(cls, value: Any) -> "JobHandle":
        if not isinstance(value, Mapping):
            raise DTrainError(f"a job handle must be a mapping, not {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing, unknown = names - set(value), set(value) - names
        if missing or unknown:
            raise DTrainError(f"not a job handle: missing {sorted(missing)}, unknown {sorted(unknown)}")
        try:
            return cls(backend=str(value["backend"]), job_id=str(value["job_id"]),
                       backend_job_id=str(value["backend_job_id"]), run_dir=str(value["run_dir"]),
                       world_size=int(value["world_size"]), submitted_at=float(value["submitted_at"]),
                       data=check_primitive("handle.data", dict(value["data"] or {})))
        except (TypeError, ValueError) as e:
            raise DTrainError(f"not a job handle: {e}") from e


@dataclass(frozen=True)
class JobStatus:
    """What a poll knows about a job. ``exit_code`` is set once ``done``; ``reachable`` False means
    the backend could not be asked this time (not a verdict: ask again)."""

    state: str
    done: bool
    exit_code: int | None = None
    failed_node: int | None = None
    reason: str = ""
    tail: Sequence[str] = ()
    reachable: bool = True
    #: a node the backend lost (dtrain.launch.core.lost.LostNode.to_dict: primitives, for a trigger's event)
    lost: Mapping[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.done and self.exit_code == 0

    @classmethod
    def of_lost_node(cls, node: "LostNode", tail: Sequence[str] = ()) -> "JobStatus":
        """The lost-node verdict (done, LOST_EXIT_CODE, the message first in the tail): the caller then
        cancels the job, which stops its reachable nodes (a cut-off one fences itself)."""
        message = node.message()
        return cls("LOST", True, LOST_EXIT_CODE, node.node, message, [message, *tail], lost=node.to_dict())


@dataclass(frozen=True)
class DryRunRequest:
    """What :meth:`Backend.submit` would run, rendered. ``argvs``: one argv per process started
    here (node agents, ssh clients, mpirun, sbatch); ``script``: a submitted script, if any;
    ``env``: variables added to the started processes (secrets included: never log it whole)."""

    backend: str
    argvs: tuple[tuple[str, ...], ...]
    script: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    stdin: tuple[str, ...] = ()

    def render(self) -> str:
        """The text ``dtrain launch --dry-run`` prints: the script, or one shell-quoted argv a line."""
        import shlex

        if self.script is not None:
            return self.script
        return "".join(shlex.join(argv) + "\n" for argv in self.argvs)


@dataclass(frozen=True)
class NodeAccess:
    """How a launcher layered on a backend (mpirun) reaches that backend's nodes.

    Args:
        addresses: one address per node, in node order (node 0 hosts the rendezvous).
        python: the interpreter on the nodes.
        ssh_config: an ssh_config text with one ``Host dtrain-nodeN`` alias per node, for
            mpirun's rsh agent; None when every node is this host.
        loopback: every node is on this host (collectives then use the loopback interface).
        endpoints: each node's login (address, port), in node order: what its lease reaches (the next
            node's) and what the launcher probes when a node seems lost; empty on this host.
        lost_after: seconds a node may be silent before it is lost and fences itself (its lease); None:
            the nodes hold no lease (this host).
    """

    addresses: tuple[str, ...]
    python: str
    ssh_config: str | None = None
    loopback: bool = True
    endpoints: tuple[tuple[str, int], ...] = ()
    lost_after: float | None = None


@dataclass
class BackendOutcome:
    """How a blocking :meth:`Backend.run` ended. ``exit_code`` 0: every node succeeded; -1: stopped."""

    exit_code: int
    node_index: int | None = None
    tail: list[str] = field(default_factory=list)
    stopped: bool = False
    state: str = ""  # the backend's final state (COMPLETED, FAILED, ...); "" when stopped
    lost: Mapping[str, Any] | None = None  # the node the job lost (JobStatus.lost)


class Backend(abc.ABC):
    """Runs jobs on one kind of infrastructure. Subclasses set ``name`` and implement the
    abstract methods; ``terminate`` may be called from another thread or a signal handler and
    must leave no process of the job alive anywhere."""

    name: ClassVar[str] = "base"
    description: ClassVar[str] = ""
    install_hint: ClassVar[str] = ""
    #: option names accepted in ``spec.backend_options`` (validated by :meth:`validate`)
    option_names: ClassVar[tuple[str, ...]] = ()
    #: submit(detached=True) gives a job that outlives this process (deferrable mode)
    supports_detached: ClassVar[bool] = False
    #: runs elastic jobs (``nodes="MIN:MAX"``: :mod:`dtrain.launch.core.elastic`)
    supports_elastic: ClassVar[bool] = False
    #: nodes are simulated on this host (preflight then checks one host)
    single_host: ClassVar[bool] = False
    #: the backend gives the ranks ``spec.secret_env`` (credentials) on a channel that is no argv, no
    #: dry-run output, no log and no file (a process's environment, an ssh session's stdin). Off unless
    #: a backend's author checked where its env travels: a secret is refused by the others.
    carries_secret_env: ClassVar[bool] = False
    #: module with ``add_arguments(parser)`` and ``options_from_args(args)``: this backend's CLI options
    cli_module: ClassVar[str | None] = None
    #: the distributions this backend starts itself (checked before anything starts); one it hands to
    #: another backend (:meth:`runner`) is that backend's to serve
    distributions: ClassVar[tuple[str, ...]] = ("pytorch", "deepspeed", "tensorflow")
    poll_interval: float = 0.02
    #: an elastic job's rounds as this backend saw them form (dtrain.launch.core.elastic.Rounds); None otherwise
    rounds: Any = None
    #: called with each round of an elastic job as it forms (the launcher's hang watch follows the world size)
    on_round: Callable[[Any], None] | None = None
    #: seconds between SIGTERM and SIGKILL on a stop; None: the spec's ``stop_grace``
    grace_seconds: float | None = None

    def __init__(self, sink: LineSink = print_sink):
        self.sink = sink
        self._stop = threading.Event()

    # -- options and validation (class level: no instance, no I/O beyond checks) -------------------

    @classmethod
    def runner(cls, distribution: str) -> str:
        """The registered backend that runs a job of ``distribution`` placed on this one (a backend
        may hand a distribution to another, e.g. local and ssh hand distribution='mpi' to mpirun)."""
        return cls.name

    @classmethod
    def resolve_placement(cls, placement: "Placement") -> Any:
        """Check this backend's options for ``placement`` (SpecError naming field, value, what is
        allowed) and return what they resolve to, typed: kept as ``placement.resolved`` and read from
        there on (the options are never rewritten). Default: no options accepted."""
        cls.check_option_names(placement.options)
        return dict(placement.options)

    @classmethod
    def validate(cls, spec: "LaunchSpec") -> None:
        """Refuse a job on a valid placement that this backend still cannot run (SpecError). Default: none."""

    @classmethod
    def check_option_names(cls, options: Mapping[str, Any]) -> None:
        unknown = sorted(set(options) - set(cls.option_names))
        if unknown:
            allowed = ", ".join(cls.option_names) or "none"
            raise SpecError(f"backend_options[{cls.name!r}]", unknown[0], f"options of backend {cls.name!r}: {allowed}")

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this backend's ``dtrain launch`` options (an argument group of its own)."""
        if cls.cli_module:
            importlib.import_module(cls.cli_module).add_arguments(parser)

    @classmethod
    def options_from_cli(cls, args: argparse.Namespace) -> dict[str, Any]:
        """This backend's options given on the command line (only those the user set)."""
        return importlib.import_module(cls.cli_module).options_from_args(args) if cls.cli_module else {}

    @classmethod
    def resolve_operator_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """Options given to an operator, completed at execute time (e.g. from an Airflow connection)."""
        return dict(options)

    @classmethod
    def node_commands(cls, placement: "Placement", argv: Sequence[str]) -> list[tuple[str, list[str]]]:
        """(host label, argv) that runs ``argv`` once on each node of ``placement``: how preflight checks nodes."""
        raise SpecError("backend", cls.name, "a backend that can run a command on each node (preflight)")

    @classmethod
    def node_fanout(cls, placement: "Placement") -> int:
        """How many of :meth:`node_commands` may run at once."""
        return 32

    @classmethod
    def node_access(cls, placement: "Placement") -> NodeAccess:
        """How to reach the nodes (default: every node is this host)."""
        import sys

        return NodeAccess(addresses=("127.0.0.1",) * placement.nodes, python=sys.executable)

    @classmethod
    def on_this_host(cls, placement: "Placement") -> bool:
        """Every node of ``placement`` is this host (its collectives then talk over loopback)."""
        return cls.node_access(placement).loopback

    def free_port(self, spec: "LaunchSpec") -> int:
        """A rendezvous port free on node 0 right now (default: on this host)."""
        return spec.rdzv_port or free_port("127.0.0.1")

    def stop_grace(self, spec: "LaunchSpec") -> float:
        """Seconds a stop gives the ranks between SIGTERM and SIGKILL."""
        return spec.stop_grace if self.grace_seconds is None else self.grace_seconds

    def node_env(self, job: "Job", node_index: int | None = None, *, port: int | None = None) -> dict[str, str]:
        """What the processes of node ``node_index`` get on top of the node's own environment: the same
        on every backend (tests/launch/backends/contract.py); a backend adds only its extras to this.

        * the stop grace: torchrun's SIGTERM-to-SIGKILL wait and the ranks' ``DTRAIN_STOP_GRACE``;
        * distribution ``tensorflow``: the TF cluster (node addresses, ports from ``port`` + 1), from
          which each rank's wrapper writes its ``TF_CONFIG``;
        * the job's rank environment (the spec's ``env`` last: the user's value wins);
        * ``DTRAIN_NODE_INDEX``. None: one environment for every node, the index set per node where the
          node is known (at start here, from SLURM_NODEID, from the rank's NODE_RANK under mpirun).
        """
        spec = job.spec
        addresses = self.node_access(spec.placement).addresses if spec.distribution == "tensorflow" else ()
        return contract_node_env(job, node_index, grace=self.stop_grace(spec), addresses=addresses, port=port)

    # -- the job lifecycle -----------------------------------------------------------------------

    @abc.abstractmethod
    def dryrun(self, job: "Job", *, detached: bool = False) -> DryRunRequest:
        """What submit would run, with every choice (ports, hosts) made; starts and writes nothing."""

    @abc.abstractmethod
    def submit(self, job: "Job", *, detached: bool = False) -> JobHandle:
        """Start the job and return at once."""

    @abc.abstractmethod
    def poll(self, handle: JobHandle) -> JobStatus:
        """The job's status now. Raises DTrainError when the backend cannot be asked."""

    async def async_poll(self, handle: JobHandle) -> JobStatus:
        """Poll without blocking an event loop (the triggerer's). Override with real async I/O."""
        import asyncio  # loaded by the running loop already; a launcher never imports it

        return await asyncio.to_thread(self.poll, handle)

    @abc.abstractmethod
    def cancel(self, handle: JobHandle, grace: float | None = None) -> None:
        """Stop every process of the job on every host; idempotent; returns when they are gone.
        Ranks get ``grace`` seconds after SIGTERM (default: the spec's ``stop_grace``)."""

    async def async_cancel(self, handle: JobHandle, grace: float | None = None) -> None:
        import asyncio

        await asyncio.to_thread(self.cancel, handle, grace)

    @abc.abstractmethod
    def logs(self, handle: JobHandle, lines: int = 40) -> list[str]:
        """The last ``lines`` lines of the job's output."""

    def follow(self, handle: JobHandle) -> None:
        """Emit new output lines to the sink (called between polls by :meth:`run`). Backends whose
        output already streams (reader threads) keep the default."""

    def release(self, handle: JobHandle) -> None:
        """Free what submit holds in this process once the job is over (threads, pipes)."""

    def run(self, job: "Job") -> BackendOutcome:
        """Submit, then :meth:`watch` the job to its end."""
        return self.watch(self.submit(job))

    def watch(self, handle: JobHandle, grace: float | None = None,
              kept: Callable[[], str | None] | None = None) -> BackendOutcome:
        """Follow a submitted job to its end (streaming its output between polls), and how it ended.
        The one way a job is followed: here after :meth:`submit`, and by a retry re-attaching to a
        job an earlier try submitted. A failed node, a stop (:meth:`terminate`) or any error here
        cancels the whole job (ranks get ``grace`` seconds after SIGTERM; default the spec's); an error
        is raised after that (DTrainError: the backend could not be asked, poll after poll).
        ``kept()``: why the job must outlive this follower, if it must (another try of the task follows
        it: :class:`dtrain.launch.engine.following.Following`); then this follower stops alone."""
        try:
            status = self._wait(handle)
        except BaseException:
            # whatever went wrong here, the job must not run on unwatched
            self._end(handle, cancel=True, grace=grace, kept=kept)
            raise
        if status is not None and status.lost:  # the others cannot reach a checkpoint without it
            grace = STUCK_GRACE_S if grace is None else min(grace, STUCK_GRACE_S)
        self._end(handle, cancel=status is None or not status.ok, grace=grace, kept=kept)
        if status is None:
            return BackendOutcome(exit_code=-1, stopped=True)
        code = status.exit_code if status.exit_code is not None else (0 if status.ok else 1)
        return BackendOutcome(exit_code=code, node_index=status.failed_node,
                              tail=[] if status.ok else list(status.tail), state=status.state, lost=status.lost)

    def _end(self, handle: JobHandle, *, cancel: bool, grace: float | None,
             kept: Callable[[], str | None] | None = None) -> None:
        why = kept() if cancel and kept is not None else None
        if why:
            self.sink(f"[dtrain] leaving {self.name} job {handle.backend_job_id} running: {why}")
            cancel = False
        if cancel:
            self.cancel(handle, grace)  # a failed node: stop the others; stopped: stop everything
        self.follow(handle)
        self.release(handle)

    def _wait(self, handle: JobHandle) -> JobStatus | None:
        errors = 0
        while not self._stop.is_set():
            self.follow(handle)
            try:
                status = self.poll(handle)
            except DTrainError as e:  # the backend could not be asked (a restarting controller)
                status = JobStatus(state="UNKNOWN", done=False, reason=str(e), reachable=False)
            errors = 0 if status.reachable else errors + 1
            if errors:
                self.sink(f"[dtrain] polling {self.name} job {handle.backend_job_id} failed "
                          f"({errors}/{MAX_POLL_ERRORS}): {status.reason}")
                if errors >= MAX_POLL_ERRORS:
                    raise DTrainError(f"lost track of {self.name} job {handle.backend_job_id}: {status.reason}")
            if status.done:
                return status
            self._stop.wait(self.poll_interval)
        return None

    def terminate(self, grace: float | None = None) -> None:
        """Ask :meth:`run` to stop; it cancels the job (ranks get ``grace`` seconds after SIGTERM,
        default the spec's ``stop_grace``). Safe from signal handlers."""
        self._stop.set()


def contract_node_env(job: "Job", node_index: int | None, *, grace: float,
                      addresses: Sequence[str] = (), port: int | None = None) -> dict[str, str]:
    """:meth:`Backend.node_env` from values: pure (a renderer without a backend instance uses it). The socket
    interface is not in it: each node picks its own (:mod:`dtrain.launch.node.netif`)."""
    spec = job.spec
    env = stop_grace_env(grace)
    if spec.distribution == "tensorflow":
        from dtrain.launch.node.tf_config import DEFAULT_PORT, backend_env

        env.update(backend_env(addresses, port + 1 if port else DEFAULT_PORT, spec.parameter_servers))
    env.update(job.rank_env)
    if node_index is not None:
        env["DTRAIN_NODE_INDEX"] = str(node_index)
    return env


async def run_async(argv: Sequence[str], timeout: float = 60.0, stdin: bytes | None = None) -> tuple[int, str, str]:
    """Run a client command (scontrol, ssh...) without blocking the triggerer's event loop."""
    import asyncio

    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    except FileNotFoundError as e:
        raise DTrainError(f"{argv[0]} not found on this host") from e
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
