"""Launch a spec on a backend and report how it went: the engine behind the operator and the CLI."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dtrain.errors import LaunchError
from dtrain.launch.backends import Backend, BackendOutcome, JobHandle, backend_for
from dtrain.launch.backends.base import STUCK_GRACE_S, LineSink, print_sink
from dtrain.launch.core.exits import first_failure
from dtrain.launch.core.job import Job, prepare_job
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine import hang
from dtrain.launch.engine.following import Following
from dtrain.launch.engine.stragglers import StragglerWatch
from dtrain.launch.node.lease import LOST_EXIT_CODE
from dtrain.rundir import CHECKPOINTS, METRICS, RunDir, UnsafeRunDir

STOPPED_EXIT_CODE = 143  # 128 + SIGTERM, as a shell reports a job stopped by SIGTERM


@dataclass
class LaunchResult:
    job_id: str
    run_dir: str
    world_size: int
    exit_code: int
    duration_s: float
    checkpoint_dir: str
    metrics_dir: str
    failed_rank: int | None = None
    failed_node: int | None = None
    tail: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    stall: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False
    hang: dict[str, Any] = field(default_factory=dict)
    lost: dict[str, Any] = field(default_factory=dict)  # the node the job lost (dtrain.launch.core.lost)
    state: str = ""  # the backend's final job state when it reports one (PREEMPTED, NODE_FAIL...)
    #: an elastic job's rounds: {round, nodes (node indexes by group rank), world_size, resume_step}
    rounds: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of_job(cls, job_id: str, run_dir: str, world_size: int, exit_code: int, duration_s: float) -> "LaunchResult":
        """The result of a job that ended with ``exit_code``, as its run directory tells it: where its
        checkpoints and metrics are, and the result rank 0 wrote. The one builder, for a job this
        process followed (:class:`Launcher`) and for one a trigger followed (deferrable resume)."""
        return cls(job_id=job_id, run_dir=run_dir, world_size=world_size, exit_code=exit_code,
                   duration_s=round(duration_s, 3), checkpoint_dir=os.path.join(run_dir, CHECKPOINTS),
                   metrics_dir=os.path.join(run_dir, METRICS), metrics=read_metrics(run_dir))

    def take_first_failure(self) -> bool:
        """Name the rank that failed first, from the ranks' exit records: its exit code, rank, node and
        own last lines. False when no rank recorded a failure (none ran to its end)."""
        failure = first_failure(self.run_dir)
        if failure is None:
            return False
        self.exit_code, self.failed_rank = failure["exit_code"], failure["rank"]
        self.failed_node, self.tail = failure["node_rank"], failure["tail"]
        return True

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def raise_for_status(self) -> None:
        if self.hang:
            raise LaunchError(f"job {self.job_id} {self.hang['message']}", self.exit_code,
                              (self.hang["stuck_ranks"] or [None])[0], self.tail)
        if self.lost:
            raise LaunchError(f"job {self.job_id} {self.lost['message']}", self.exit_code, None, self.tail,
                              self.state or None)
        if self.stopped:
            raise LaunchError(f"job {self.job_id} was stopped", self.exit_code, state=self.state or None)
        if not self.ok:
            where = f"rank {self.failed_rank}" if self.failed_rank is not None else f"node {self.failed_node}"
            raise LaunchError(f"job {self.job_id} failed: {where} exited with {self.exit_code}",
                              self.exit_code, self.failed_rank, self.tail, self.state or None)

    def to_xcom(self) -> dict[str, Any]:
        """Primitives only: what the operator pushes to XCom."""
        data = asdict(self)
        data["tail"] = data["tail"][-10:]
        return data


def read_metrics(run_dir: str) -> dict[str, Any]:
    """The result the training script's rank 0 wrote (``metrics/result.json``): a JSON object read
    without following a link, bounded; {} when there is none."""
    try:
        return RunDir(run_dir).result()
    except UnsafeRunDir:
        return {}


class Launcher:
    """Runs one spec to completion. ``terminate()`` is safe from signal handlers and other threads."""

    def __init__(self, spec: LaunchSpec, sink: LineSink = print_sink, backend: Backend | None = None):
        self.spec = spec
        self.sink = sink
        # The registry picks the class (a backend may hand the job on, e.g. distribution=mpi to mpirun).
        self.backend = backend or backend_for(spec)(sink=sink)
        self.job: Job | None = None
        self._terminated = threading.Event()
        self.hang_verdict: hang.HangVerdict | None = None
        self.following = False  # attach() is following a detached job now (leave() can leave it)

    def run(self, job: Job | None = None) -> LaunchResult:
        """Run the spec to its end. ``job``: one already prepared (:meth:`attach` passes the job a
        handle names, whose exit records must survive); default: a new one."""
        self.job = job = job or prepare_job(self.spec)
        placement = self.spec.placement
        self.sink(f"[dtrain] job {job.job_id}: {placement.nnodes} node(s) x {placement.procs_per_node} proc(s), "
                  f"distribution={self.spec.distribution}, backend={placement.backend}, run_dir={job.run_dir}")
        started = time.monotonic()
        watch = self._watch_for_hangs(job)
        stragglers = StragglerWatch(os.path.join(job.run_dir, METRICS), self.sink).start()
        try:
            outcome = self.backend.run(job)
        except LaunchError as e:  # the job could not start (a host unreachable, sbatch refused)
            self.sink(f"[dtrain] {e}")
            outcome = BackendOutcome(exit_code=e.exit_code or 1, tail=e.tail or [str(e).splitlines()[0]])
        finally:
            stragglers.stop()
            if watch is not None:
                watch.stop()
        result = LaunchResult.of_job(job.job_id, job.run_dir, self.spec.world_size, outcome.exit_code,
                                     time.monotonic() - started)
        if self.backend.rounds is not None:
            result.rounds = self.backend.rounds.to_list()
        self._report_stalls(result)
        if self.hang_verdict is not None:
            result.exit_code = hang.HANG_EXIT_CODE
            result.hang = {**self.hang_verdict.to_dict(), "message": self.hang_verdict.message()}
            result.failed_rank = (self.hang_verdict.stuck_ranks or [None])[0]
        elif outcome.stopped or self._terminated.is_set():
            result.exit_code, result.stopped = STOPPED_EXIT_CODE, True
        elif outcome.lost:  # the ranks that failed after it lost their peers: not the cause
            result.exit_code, result.lost = LOST_EXIT_CODE, dict(outcome.lost)
            result.failed_node, result.tail = outcome.lost["node"], outcome.tail
        elif outcome.exit_code != 0 and not result.take_first_failure():
            result.failed_node, result.tail = outcome.node_index, outcome.tail
        self.sink(f"[dtrain] job {job.job_id} finished: exit_code={result.exit_code} in {result.duration_s:.1f}s"
                  + (f" (hung: rank(s) {', '.join(map(str, result.hang['stuck_ranks']))} stuck)" if result.hang
                     else f" ({result.lost['message']})" if result.lost
                     else f" (rank {result.failed_rank} failed first)" if result.failed_rank is not None else ""))
        return result

    def _watch_for_hangs(self, job: Job) -> hang.HangWatch | None:
        """With ``hang_timeout`` set, give every rank the dump/flight-recorder env and watch
        its progress; a hang tears the job down (see dtrain.launch.engine.hang)."""
        if self.spec.hang_timeout is None:
            return None
        job.rank_env.update(hang.rank_env(job.run_dir, job.rank_env))
        watch = hang.HangWatch(job.run_dir, self.spec.world_size, self.spec.hang_timeout,
                               on_hang=self._on_hang, sink=self.sink)
        if self.spec.elastic:  # watch the ranks of the current round: those of a lost node stopped for good
            self.backend.on_round = lambda round_: setattr(watch.detector, "world_size", round_.world_size)
        return watch.start()

    def _on_hang(self, verdict: hang.HangVerdict) -> None:
        self.hang_verdict = verdict
        self.backend.terminate(grace=STUCK_GRACE_S)

    def _report_stalls(self, result: LaunchResult) -> None:
        """Per-rank step time, data-wait fraction and samples/s, with the CPUBottleneck and
        LoadBalancing verdicts, from the metrics the training helper wrote (if any)."""
        from dtrain.stall_report import format_report, summarize

        try:
            result.stall = summarize(result.metrics_dir)
        except (OSError, ValueError) as e:  # a report must never turn a finished job into a failure
            self.sink(f"[stall] no report: {e}")
            return
        if result.stall.get("ranks"):
            for line in format_report(result.stall):
                self.sink(line)

    def terminate(self) -> None:
        self._terminated.set()
        self.backend.terminate()

    def leave(self, why: str) -> None:
        """Stop following the detached job :meth:`attach` follows (while :attr:`following`) without
        stopping it (``why``: who follows it instead). Safe from signal handlers."""
        self._terminated.set()
        self.backend.leave(why)

    # -- detached jobs: submitted by one process, followed by it or by a later one -----------------

    def submit_detached(self) -> JobHandle:
        """Start the job so that it outlives this process (a worker crash leaves it running), and
        return its handle; :meth:`attach` follows it, here or after a restart."""
        self.job = job = prepare_job(self.spec)
        if self.spec.hang_timeout is not None:  # the ranks report progress to the watch attach() starts
            hang.clear_previous(job.run_dir)
            job.rank_env.update(hang.rank_env(job.run_dir, job.rank_env))
        return self.backend.submit(job, detached=True)

    def attach(self, handle: JobHandle, follower: int | None = None) -> LaunchResult:
        """Follow the job ``handle`` names until it ends, with :meth:`run`'s watch, teardown and
        result; output and failure records are read from its run directory. ``follower``: the try of
        the task following it (:class:`Following`)."""
        backend = self.backend.backend if isinstance(self.backend, Following) else self.backend
        following = self.backend = Following(backend, handle, follower)
        self.following = True
        try:
            result = self.run(job=Job(spec=self.spec, job_id=handle.job_id, run_dir=handle.run_dir))
        finally:
            self.following = False
        result.state = following.state
        result.duration_s = round(time.time() - handle.submitted_at, 3)  # the job's, not this follower's
        return result


def launch(spec: LaunchSpec, sink: LineSink = print_sink) -> LaunchResult:
    """Run ``spec`` and raise :class:`LaunchError` if it failed."""
    result = Launcher(spec, sink=sink).run()
    result.raise_for_status()
    return result
