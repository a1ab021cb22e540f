"""Local backend: every node simulated on this host, one torchrun agent each.

c10d rendezvous on 127.0.0.1 at a port chosen per job; each agent in its own session;
teardown of every rank on any failure, stop, or signal. The agents are children of this
process (they die with it: parent-death signal), so a local job cannot be detached.

An elastic job (``nodes="MIN:MAX"``) simulates node loss: its rendezvous store is a process of
its own (:mod:`dtrain.launch.core.rdzv_store`), so any agent may go; an agent that ends by a signal
this backend did not send is a lost node (:mod:`dtrain.launch.core.elastic`).

A stop gives every rank the spec's ``stop_grace`` between SIGTERM and SIGKILL (to save a
checkpoint: :mod:`dtrain.training.preemption`): the supervisor waits that long, but only while a
process of the job still runs, and each torchrun agent is told the same through
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``. ``cancel(handle, grace=...)`` and ``terminate(grace=...)``
take a shorter one (a hung job has nothing to save).
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from typing import Sequence

from dtrain.errors import SpecError
from dtrain.launch.backends.base import Backend, DryRunRequest, JobHandle, JobStatus
from dtrain.launch.core.elastic import Membership, Rounds
from dtrain.launch.core.job import Job
from dtrain.launch.core.lost import LostNode
from dtrain.launch.backends.placement import Placement
from dtrain.launch.core.processes import IDLE_CHECK_S, AgentLogs, NodeProcess, NodeSupervisor
from dtrain.launch.core.rdzv_store import RendezvousStore
from dtrain.launch.core.torchrun import C10d, Elastic, agent_argv
from dtrain.launch.node.rdzv_auth import StoreKey, secret_line

LOOPBACK = "127.0.0.1"


class LocalBackend(Backend):
    """Nodes simulated on this host: one torchrun agent per node, c10d on loopback."""

    name = "local"
    description = "every node simulated on this host (one torchrun agent each)"
    install_hint = "pip install 'airflow-dtrain[torch]'"
    single_host = True
    supports_elastic = True
    carries_secret_env = True  # the agents' process environment

    def __init__(self, sink=None, python: str | None = None, grace_seconds: float | None = None):
        super().__init__(**({"sink": sink} if sink else {}))
        self.python = python or sys.executable
        #: seconds between SIGTERM and SIGKILL on a stop; None: the spec's stop_grace (set at submit)
        self.grace_seconds = grace_seconds
        self.supervisor = NodeSupervisor(self._node_line, grace_seconds=5.0 if grace_seconds is None else grace_seconds)
        self.store: RendezvousStore | None = None  # an elastic job's
        self.membership: Membership | None = None
        self.rounds: Rounds | None = None

    def _node_line(self, line: str) -> None:
        if self.rounds is None or not self.rounds.feed(line):
            self.sink(line)

    @classmethod
    def runner(cls, distribution: str) -> str:
        return "mpi" if distribution == "mpi" else cls.name  # mpirun starts the ranks itself

    @classmethod
    def node_commands(cls, placement: Placement, python_args: Sequence[str]) -> list[tuple[str, list[str]]]:
        return [("localhost", [sys.executable, *python_args]) for _ in range(placement.nodes)]

    @staticmethod
    def _refuse_detached(detached: bool) -> None:
        if detached:
            raise SpecError("deferrable", True, "a backend whose jobs outlive the worker (not 'local': its "
                                                "agents are children of the task)")

    def dryrun(self, job: Job, *, detached: bool = False) -> DryRunRequest:
        self._refuse_detached(detached)
        return self._request(job, self.free_port(job.spec))

    def _request(self, job: Job, port: int) -> DryRunRequest:
        spec = job.spec
        argvs = tuple(tuple(agent_argv(spec, python=self.python, job_id=job.job_id,
                                       rdzv=Elastic(LOOPBACK, port, LOOPBACK) if spec.elastic
                                       else C10d(LOOPBACK, port, is_host=i == 0)))
                      for i in range(spec.placement.nodes))
        return DryRunRequest(backend=self.name, argvs=argvs, env=self.node_env(job, port=port))

    def submit(self, job: Job, *, detached: bool = False) -> JobHandle:
        self._refuse_detached(detached)
        port = self.free_port(job.spec)
        request = self._request(job, port)
        base_env = {**os.environ, **request.env}
        envs = [dict(base_env, DTRAIN_NODE_INDEX=str(i)) for i in range(len(request.argvs))]
        self.supervisor.job_id = job.job_id  # teardown also finds what left the tree
        self.supervisor.grace_seconds = self.stop_grace(job.spec)
        self.supervisor.stopping_sink = AgentLogs(job.run_dir)  # a stop's shutdown chatter: see NodeSupervisor
        secret = None
        if job.spec.elastic:
            secret = secrets.token_hex(32)  # the rendezvous' key: to the store and the agents on stdin only
            self._start_elastic(job, port, secret)
        self.supervisor.start(request.argvs, envs, cwd=job.spec.workdir,
                              stdin=None if secret is None else secret_line(secret))
        return JobHandle(backend=self.name, job_id=job.job_id, backend_job_id=job.job_id, run_dir=job.run_dir,
                         world_size=job.spec.world_size, submitted_at=time.time(),
                         data={"nodes": len(request.argvs)})

    def _start_elastic(self, job: Job, port: int, secret: str) -> None:
        spec = job.spec
        self.membership = Membership(spec.placement.min_nodes, self.sink)
        self.rounds = Rounds(job.run_dir, spec.placement.procs_per_node, [LOOPBACK] * spec.placement.nodes, self.sink,
                             StoreKey(secret), on_round=self.on_round)
        self.store = RendezvousStore(self.python, sink=self.sink)
        self.store.start(LOOPBACK, port, secret)
        self.sink(f"[dtrain] elastic: {spec.placement.nnodes} nodes; rendezvous store {LOOPBACK}:{self.store.port} "
                  f"(this host)")

    def _lost(self, node: NodeProcess, code: int) -> LostNode | None:
        """A simulated node is lost when its agent ends by a signal this backend did not send."""
        if code >= 0 or self.supervisor.stop_reason is not None:
            return None
        self.store.lost(node.index)  # the survivors re-form the round now, not when its keep-alive lapses
        return LostNode(node.index, LOOPBACK, "gone", f"its agent was killed (signal {-code})")

    def poll(self, handle: JobHandle) -> JobStatus:
        if self.membership is not None:
            running = self.membership.scan(self.supervisor.latest(), self._lost)
            return self.membership.status(running) or JobStatus(state="RUNNING", done=False)
        # Sleeps until an agent ends or a stop (at most IDLE_CHECK_S): the watch loop wakes on the
        # event instead of polling every poll_interval for the whole job, which cost the launcher
        # more CPU than anything else while the ranks run. A failure is seen as soon as it happens.
        self.supervisor.wait_for_change(IDLE_CHECK_S)
        done, code, node = self.supervisor.check(expected=int(handle.data["nodes"]))
        if not done:
            return JobStatus(state="RUNNING", done=False)
        return JobStatus(state="COMPLETED" if code == 0 else "FAILED", done=True, exit_code=code,
                         failed_node=None if node is None else node.index,
                         tail=[] if node is None else list(node.tail))

    def cancel(self, handle: JobHandle, grace: float | None = None) -> None:
        """SIGTERM every process of the job, SIGKILL what still runs after ``grace`` seconds
        (default: the spec's stop_grace); returns as soon as everything is gone."""
        self.supervisor.stop("cancel")
        self.supervisor.teardown(grace)

    def logs(self, handle: JobHandle, lines: int = 40) -> list[str]:
        return [line for node in list(self.supervisor.nodes) for line in node.tail][-lines:]

    def release(self, handle: JobHandle) -> None:
        self.supervisor.teardown()  # nothing left to stop after success; joins the reader threads
        if self.store is not None:
            self.store.stop()  # after the agents: they close the rendezvous in it

    def terminate(self, grace: float | None = None) -> None:
        # Tear down here rather than only flagging run(): on_kill may be the last code the
        # task process runs before it is killed itself.
        super().terminate()
        self.supervisor.stop("terminate")
        self.supervisor.teardown(grace)

    def pids(self) -> set[int]:
        return self.supervisor.pids()
