"""The Slurm backend: one sbatch job; ``srun`` starts one torchrun agent per node.

It submits with ``sbatch --parsable``, polls ``scontrol show job`` (``sacct`` only as a
fallback: without accounting storage it has no data), streams the job's output file,
returns the failing exit code and cancels with ``scancel``. A Slurm job outlives the
submitting process by nature, so every submission can be deferred or re-attached: the
handle holds the Slurm job id and the run directory, where the batch script records
srun's exit status. The pure part (options, script, parsing) is :mod:`.render`.

An elastic job (``nodes="MIN:MAX"``, blocking mode) keeps its allocation when a node fails
(``--no-kill`` on sbatch and srun, no ``--kill-on-bad-exit``); its rendezvous store runs with the
launcher, and each node leases against it. A lost node (its lease: :mod:`.lost`) ends the job only
when fewer than MIN nodes are left (:class:`~dtrain.launch.core.elastic.Membership`); the others
record their end per node. Slurm's srun waits for a lost node until SlurmdTimeout declares it down
(minutes), so once every node left has finished the launcher reports the result and cancels what
Slurm still holds. The batch script's own node is the exception: its loss ends the job (Slurm's).

A cancel gives the ranks the spec's ``stop_grace`` to save a checkpoint (Slurm's own cancel
escalates to SIGKILL after the cluster-wide ``KillWait``, which no job can set): first
``scancel --signal=TERM`` (every step's processes, no SIGKILL after it), then a wait that ends
as soon as every rank has exited (their exit records) or no step runs any more, at most the grace,
then ``scancel --full``. A job with no running step (pending, or its script not yet at srun)
is cancelled at once. The stop marker (:func:`mark_stop`) keeps the batch script from ending
before that cancel, so a stopped job ends CANCELLED.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from dataclasses import replace
from typing import Mapping

from dtrain.errors import DTrainError, LaunchError, SpecError
from dtrain.launch.backends.base import SECRET_KEY, Backend, DryRunRequest, JobHandle, JobStatus, run_async
from dtrain.launch.backends.slurm import lost
from dtrain.launch.backends.slurm import render as R
from dtrain.launch.backends.slurm.render import SlurmOptions
from dtrain.launch.core.elastic import Membership, Rounds
from dtrain.launch.core.exits import exit_records, ranks_exited_since
from dtrain.launch.core.job import Job
from dtrain.launch.core.lost import LostNode, TellOnce, fenced, shows_a_lost_node
from dtrain.launch.backends.placement import Placement
from dtrain.launch.core.rdzv_store import RendezvousStore, store_address
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.core.tailfile import TAIL_LINES, LogFollower, read_tail
from dtrain.launch.core.torchrun import Elastic
from dtrain.launch.node.lease import lease_key
from dtrain.launch.node.net import free_port
from dtrain.launch.node.rdzv_auth import StoreKey
from dtrain.rundir import RunDir


def _run(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        raise DTrainError(f"{argv[0]} not found: the slurm backend needs the Slurm client commands on PATH") from e
    except subprocess.TimeoutExpired as e:
        raise DTrainError(f"{' '.join(argv[:3])} did not answer within {timeout:.0f}s") from e


def sbatch(script_path: str, cwd: str | None = None, secret_env: Mapping[str, str] | None = None) -> str:
    """``sbatch --parsable SCRIPT`` -> the Slurm job id. ``secret_env`` goes into sbatch's own
    environment, which sbatch hands to the job (its default ``--export=ALL``; the option is not among
    the allowed extra_sbatch), never into the script: that is the dry-run output and a file."""
    env = {**os.environ, **secret_env} if secret_env else None
    proc = subprocess.run(R.sbatch_argv(script_path), capture_output=True, text=True, timeout=120, cwd=cwd,
                          stdin=subprocess.DEVNULL, env=env)
    if proc.returncode != 0:
        raise LaunchError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}", proc.returncode)
    return R.parse_job_id(proc.stdout)


def query(job_id: str, run_dir: str) -> JobStatus:
    """The job's status now: scontrol first; sacct if scontrol forgot it; the script's record."""
    proc = _run(R.show_job_argv(job_id))
    fields = R.fields_or_raise(job_id, proc.returncode, proc.stdout, proc.stderr)
    if not fields.get("JobState"):
        try:
            acct = _run(R.sacct_argv(job_id))
            fields = R.parse_sacct(acct.stdout) if acct.returncode == 0 else {}
        except DTrainError:
            fields = {}
    return R.decide(job_id, fields, R.read_exit_record(run_dir, job_id))


async def async_query(job_id: str, run_dir: str) -> JobStatus:
    """Async twin of :func:`query` (same argv, same decision), for the triggerer."""
    try:
        rc, out, err = await run_async(R.show_job_argv(job_id))
    except TimeoutError as e:
        raise DTrainError(f"scontrol show job {job_id} timed out") from e
    fields = R.fields_or_raise(job_id, rc, out, err)
    if not fields.get("JobState") and shutil.which("sacct"):
        try:
            rc, out, _ = await run_async(R.sacct_argv(job_id))
            fields = R.parse_sacct(out) if rc == 0 else {}
        except (TimeoutError, DTrainError):
            fields = {}
    return R.decide(job_id, fields, R.read_exit_record(run_dir, job_id))


def scancel(job_id: str) -> None:
    proc = _run(R.cancel_argv(job_id))
    if proc.returncode != 0 and "already completed" not in proc.stderr and "Invalid job id" not in proc.stderr:
        raise DTrainError(f"scancel {job_id} failed: {proc.stderr.strip()}")


#: seconds a cancel waits for Slurm to end a job that lost a node (it cannot end it before SlurmdTimeout)
LOST_CANCEL_WAIT_S = 5.0
#: a handle from before the field existed has no stop_grace: the spec's default
DEFAULT_STOP_GRACE = 30.0
#: seconds between two looks at the ranks' exit records while they use their grace period (a
#: directory listing: cheap), and between two looks at the job's steps (squeue: an RPC)
RECORDS_POLL_INTERVAL = 0.05
GRACE_POLL_INTERVAL = 0.5


def handle_grace(handle: JobHandle, grace: float | None) -> float:
    return float(grace) if grace is not None else float(handle.data.get("stop_grace", DEFAULT_STOP_GRACE))


def mark_stop(run_dir: str, job_id: str) -> None:
    """Tell the batch script that the launcher stops the job (it then waits for the cancel instead
    of ending with the ranks' 143: the job ends CANCELLED whoever wins the race)."""
    try:
        RunDir(run_dir).write(os.path.basename(R.stop_path(run_dir, job_id)), data=f"{time.time()}\n".encode())
    except (OSError, ValueError):
        pass  # the stop still happens; the job may then end FAILED (143) instead of CANCELLED


def signal_ranks(job_id: str, run_dir: str) -> bool:
    """SIGTERM to every step of the job, if one runs; False when there is none (nothing would
    get the signal: the job is pending, its script not yet at srun, or it is ending)."""
    steps = _run(R.steps_argv(job_id))
    if steps.returncode != 0 or not R.running_steps(steps.stdout):
        return False
    mark_stop(run_dir, job_id)
    return _run(R.signal_argv(job_id)).returncode == 0


def steps_running(job_id: str) -> bool:
    """Whether a step of the job (not its batch script) still runs; True when Slurm cannot say."""
    steps = _run(R.steps_argv(job_id))
    return steps.returncode != 0 or bool(R.running_steps(steps.stdout))


def stop_gracefully(job_id: str, run_dir: str, world_size: int, grace: float) -> None:
    """SIGTERM the ranks and wait until every one of them exited (its exit record), or no step of
    the job runs any more (ranks that never started, a job ending), at most ``grace`` seconds (+1
    for the records to land). The caller then cancels what is left (agents, node shells)."""
    before = exit_records(run_dir)
    if grace <= 0 or not signal_ranks(job_id, run_dir):
        return
    deadline = time.monotonic() + grace + 1.0
    asked = time.monotonic()
    while time.monotonic() < deadline:
        if ranks_exited_since(before, exit_records(run_dir), world_size):
            return
        if time.monotonic() - asked >= GRACE_POLL_INTERVAL:
            asked = time.monotonic()
            if not steps_running(job_id):
                return
        time.sleep(RECORDS_POLL_INTERVAL)


def wait_until_done(job_id: str, run_dir: str, timeout: float = 60.0, interval: float = 0.25) -> JobStatus:
    """Poll until the job is in a terminal state (COMPLETING counts as still running:
    its processes are being killed)."""
    deadline = time.monotonic() + timeout
    status = query(job_id, run_dir)
    while not status.done and time.monotonic() < deadline:
        time.sleep(interval)
        status = query(job_id, run_dir)
    return status


def lost_node_of(handle: JobHandle, status: JobStatus, report=lambda line: None) -> LostNode | None:
    """The node a running or failed job lost (:mod:`.lost`); None for a job submitted without
    leases or their key (an earlier release's handle), a pending, completed or unanswered one.
    ``report``: where refused lease records and suspect nodes are named."""
    lost_after, nodes = handle.data.get("lost_after"), handle.data.get("nodes")
    if not (isinstance(lost_after, (int, float)) and isinstance(nodes, int)) or not status.reachable or status.ok:
        return None
    if not status.done and status.state != "RUNNING":
        return None
    key = lost.job_key(handle.job_id, handle.data)
    if key is None:  # its leases' records cannot be told from a rank's
        return None
    return lost.lost_node(handle.job_id, handle.backend_job_id, handle.run_dir, nodes, float(lost_after),
                          failed=status.done, key=key, report=report)


class SlurmBackend(Backend):
    """Submit the job with sbatch and follow it until it ends; ``cancel`` scancels it."""

    name = "slurm"
    description = "one sbatch job; srun starts one torchrun agent per node"
    install_hint = "apt-get install slurm-client (sbatch, squeue, scontrol, scancel)"
    options = R.SLURM_OPTIONS  # its backend_options, declared once (flags, checks, docs/backends.md)
    option_names = R.SLURM_OPTIONS.names
    supports_detached = True
    supports_elastic = True
    cli_module = "dtrain.launch.backends.slurm.cli"
    carries_secret_env = True  # sbatch's environment, not the script (see sbatch())
    #: torchrun agents only; the node addresses a TF cluster needs exist only once the job runs
    distributions = ("pytorch", "deepspeed")

    def __init__(self, sink=None, cancel_timeout: float = 60.0, grace_seconds: float | None = None):
        super().__init__(**({"sink": sink} if sink else {}))
        self.cancel_timeout = cancel_timeout
        #: seconds the ranks get between SIGTERM and the cancel; None: the spec's stop_grace
        self.grace_seconds = grace_seconds
        self._terminate_grace: float | None = None
        self._followers: dict[str, LogFollower] = {}
        self.store: RendezvousStore | None = None  # an elastic job's (and its bookkeeping)
        self.membership: Membership | None = None
        self._ended: set[int] = set()
        self._told = TellOnce(self.sink)  # refused lease records, suspect nodes: once each

    @classmethod
    def resolve_placement(cls, placement: Placement) -> SlurmOptions:
        return R.coerce_options(placement.options)  # SpecError naming an unknown or bad option

    @classmethod
    def validate(cls, spec: LaunchSpec) -> None:
        if spec.run_dir is not None:
            R.check_run_dir(os.path.abspath(str(spec.run_dir)))

    @classmethod
    def on_this_host(cls, placement: Placement) -> bool:
        return False  # Slurm's nodes are machines of their own

    @staticmethod
    def _options(spec: LaunchSpec) -> SlurmOptions:
        return spec.resolved

    def dryrun(self, job: Job, *, detached: bool = False) -> DryRunRequest:
        script = R.render_sbatch(job, self._options(job.spec), node_env=self.node_env(job),
                                 rdzv=self._elastic_rdzv(job.spec, detached))
        return DryRunRequest(backend=self.name, argvs=(tuple(R.sbatch_argv(R.script_path(job))),), script=script)

    @staticmethod
    def _elastic_rdzv(spec: LaunchSpec, detached: bool) -> Elastic | None:
        """An elastic job's store: on this host, at its address on the route to the cluster's nodes."""
        if not spec.elastic:
            return None
        if detached:
            raise SpecError("deferrable", True, "False for an elastic job (nodes=MIN:MAX): its rendezvous store "
                                                "lives with the launcher")
        nodes = R.parse_nodes(lost.scontrol(R.all_nodes_argv()))
        if not nodes:
            raise LaunchError("scontrol did not say where the cluster's nodes are: the elastic job's nodes "
                              "could not be told where its rendezvous store is", 1)
        return Elastic(store_address(next(iter(nodes.values()))[0]), free_port("0.0.0.0"))

    def submit(self, job: Job, *, detached: bool = False) -> JobHandle:
        options = self._options(job.spec)
        rdzv = self._elastic_rdzv(job.spec, detached)
        rdzv_secret = None  # an elastic job's rendezvous key: the nodes' secrets line, then the agents' stdin only
        if rdzv is not None:
            rdzv_secret = secrets.token_hex(32)
            self.membership = Membership(job.spec.placement.min_nodes, self.sink)
            self.rounds = Rounds(job.run_dir, job.spec.placement.procs_per_node,
                                 [f"SLURM_NODEID={i}" for i in range(job.spec.placement.nodes)], self.sink,
                                 StoreKey(rdzv_secret), tagged=False, on_round=self.on_round)
            self.store = RendezvousStore(sink=self.sink)
            self.store.start(rdzv.host, rdzv.port, rdzv_secret)
        script = R.write_script(job, options, self.node_env(job), rdzv)
        secret = secrets.token_hex(32)  # keys the nodes' lease records (lost.job_key), and the follower record
        job_id = sbatch(script, cwd=job.spec.workdir,
                        secret_env={**job.spec.secret_env,
                                    R.NODE_SECRETS_ENV: R.node_secrets(lease_key(secret), rdzv_secret)})
        self.poll_interval = options.poll_interval
        self.sink(f"[dtrain] submitted slurm job {job_id} ({job.spec.placement.nodes} node(s)); "
                  f"output: {R.log_path(job.run_dir, job_id)}")
        return JobHandle(backend=self.name, job_id=job.job_id, backend_job_id=job_id, run_dir=job.run_dir,
                         world_size=job.spec.world_size, submitted_at=time.time(),
                         data={"poll_interval": options.poll_interval,
                               "stop_grace": self.stop_grace(job.spec),
                               "lost_after": options.lost_after, "nodes": job.spec.placement.nodes, SECRET_KEY: secret})

    def _with_tail(self, handle: JobHandle, status: JobStatus) -> JobStatus:
        """A finished job's status carries the end of its output file (why it failed, or its summary)."""
        if status.done:
            return replace(status, tail=read_tail(R.log_path(handle.run_dir, handle.backend_job_id), TAIL_LINES))
        return status

    def poll(self, handle: JobHandle) -> JobStatus:
        status = self._with_tail(handle, query(handle.backend_job_id, handle.run_dir))
        if self.membership is not None:
            return self._poll_elastic(handle, status)
        return self._lost(handle, status, lost_node_of(handle, status, self._told))

    def _poll_elastic(self, handle: JobHandle, status: JobStatus) -> JobStatus:
        """An elastic job's status from its nodes' own records and leases, Slurm's state only when it
        ended by itself (cancelled, out of time): a lost node with MIN left is no end."""
        nodes, members, key = int(handle.data["nodes"]), self.membership, lost.job_key(handle.job_id, handle.data)
        for node, code in R.read_node_exits(handle.run_dir, handle.backend_job_id, nodes).items():
            # a node that fenced itself recorded its agent's end too: its lease tells it lost, below
            if node not in self._ended and (code == 0 or not fenced(handle.run_dir, handle.job_id, node, key)):
                self._ended.add(node)
                members.node_ended(node, code, [])
        if status.state == "RUNNING":
            verdict = lost.lost_node(handle.job_id, handle.backend_job_id, handle.run_dir, nodes,
                                     float(handle.data["lost_after"]), failed=False, key=key, report=self._told,
                                     exclude=self._ended | set(members.lost))
            if verdict is not None:
                self.store.lost(verdict.node)  # the survivors re-form the round now, not when its keep-alive lapses
                members.node_lost(verdict, nodes - len(self._ended) - len(members.lost) - 1)
        decided = members.status(nodes - len(self._ended) - len(members.lost))
        if decided is None:
            return status
        if decided.ok and not status.done:
            if not members.lost:
                return status  # every node finished: Slurm ends the job in a moment, COMPLETED
            self.sink(f"[dtrain] every node left has finished; cancelling slurm job {handle.backend_job_id}, "
                      f"which Slurm holds for its lost node(s) until it declares them down")
            scancel(handle.backend_job_id)
        return decided if decided.tail or decided.ok else replace(decided, tail=status.tail)

    async def async_poll(self, handle: JobHandle) -> JobStatus:
        import asyncio

        status = self._with_tail(handle, await async_query(handle.backend_job_id, handle.run_dir))
        return self._lost(handle, status, await asyncio.to_thread(lost_node_of, handle, status, self._told))

    def _lost(self, handle: JobHandle, status: JobStatus, node: LostNode | None) -> JobStatus:
        if node is not None:
            self.sink(f"[dtrain] {node.message()}: cancelling the job; a node cut off from its peer fences "
                      f"itself within {handle.data['lost_after']:g} s")
        return status if node is None else JobStatus.of_lost_node(node, status.tail)

    def follow(self, handle: JobHandle) -> None:
        follower = self._followers.setdefault(handle.backend_job_id,
                                              LogFollower(R.log_path(handle.run_dir, handle.backend_job_id),
                                                          self._output_line))
        follower.poll()

    def _output_line(self, line: str) -> None:
        if self.rounds is None or not self.rounds.feed(line):
            self.sink(line)

    def release(self, handle: JobHandle) -> None:
        follower = self._followers.pop(handle.backend_job_id, None)
        if follower is not None:
            follower.poll(final=True)
        if self.store is not None:
            self.store.stop()

    def cancel(self, handle: JobHandle, grace: float | None = None) -> None:
        """SIGTERM the ranks and give them ``grace`` seconds (default: the spec's stop_grace; the
        wait ends when they have exited), then scancel the job and wait until Slurm reports it ended."""
        grace = handle_grace(handle, grace if grace is not None else self._terminate_grace)
        job_id = handle.backend_job_id
        try:
            stop_gracefully(job_id, handle.run_dir, handle.world_size, grace)
        except DTrainError as e:  # Slurm could not be asked: the cancel below still must happen
            self.sink(f"[dtrain] stopping slurm job {job_id} gracefully failed ({e}): cancelling it")
        scancel(job_id)
        wait_until_done(job_id, handle.run_dir, timeout=self._cancel_wait(handle))

    def _cancel_wait(self, handle: JobHandle) -> float:
        """How long a cancel waits for Slurm to end the job. A lost node's step stays COMPLETING until
        Slurm gives the node up (SlurmdTimeout, minutes): waiting for that would only hold the task; the
        reachable nodes are stopped by then, and the lost one fences itself."""
        nodes = handle.data.get("nodes")
        if isinstance(nodes, int) and shows_a_lost_node(handle.run_dir, handle.job_id, nodes,
                                                        lost.job_key(handle.job_id, handle.data)):
            return min(self.cancel_timeout, LOST_CANCEL_WAIT_S)
        return self.cancel_timeout

    async def async_cancel(self, handle: JobHandle, grace: float | None = None) -> None:
        import asyncio

        grace = handle_grace(handle, grace)
        job_id = handle.backend_job_id
        before = exit_records(handle.run_dir)
        try:  # the same steps as stop_gracefully, without blocking the triggerer's loop
            signalled = False
            if grace > 0:
                rc, out, _ = await run_async(R.steps_argv(job_id))
                if rc == 0 and R.running_steps(out):
                    mark_stop(handle.run_dir, job_id)
                    rc, _, _ = await run_async(R.signal_argv(job_id))
                    signalled = rc == 0
            deadline = time.monotonic() + grace + 1.0
            asked = time.monotonic()
            while signalled and time.monotonic() < deadline:
                if ranks_exited_since(before, exit_records(handle.run_dir), handle.world_size):
                    break
                if time.monotonic() - asked >= GRACE_POLL_INTERVAL:
                    asked = time.monotonic()
                    rc, out, _ = await run_async(R.steps_argv(job_id))
                    if rc == 0 and not R.running_steps(out):
                        break
                await asyncio.sleep(RECORDS_POLL_INTERVAL)
        except (DTrainError, TimeoutError, asyncio.TimeoutError) as e:
            self.sink(f"[dtrain] stopping slurm job {job_id} gracefully failed ({e}): cancelling it")
        rc, _, err = await run_async(R.cancel_argv(job_id))
        if rc != 0 and "Invalid job id" not in err and "already completed" not in err:
            self.sink(f"[dtrain] scancel {job_id}: {err.strip()}")

    def terminate(self, grace: float | None = None) -> None:
        """Ask run() to stop; it cancels the job (with ``grace``, if given, instead of the spec's)."""
        if grace is not None:
            self._terminate_grace = grace
        super().terminate()

    def logs(self, handle: JobHandle, lines: int = 40) -> list[str]:
        return read_tail(R.log_path(handle.run_dir, handle.backend_job_id), lines)

    def watch(self, handle: JobHandle, grace: float | None = None, kept=None):
        outcome = super().watch(handle, grace, kept)
        if outcome.exit_code > 0:
            self.sink(f"[dtrain] slurm job ended with exit code {outcome.exit_code}")
        return outcome


__all__ = ["SlurmBackend", "SlurmOptions", "query", "wait_until_done", "sbatch", "scancel"]
