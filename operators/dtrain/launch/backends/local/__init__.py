"""Local backend: every node simulated on this host, one torchrun agent each.

c10d rendezvous on 127.0.0.1 at a port chosen per job; each agent in its own session;
teardown of every rank on any failure, stop, or signal. The agents are children of this
process (they die with it: parent-death signal), so a local job cannot be detached.

A stop gives every rank the spec's ``stop_grace`` between SIGTERM and SIGKILL (to save a
checkpoint: :mod:`dtrain.training.preemption`): the supervisor waits that long, but only while a
process of the job still runs, and each torchrun agent is told the same through
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``. ``cancel(handle, grace=...)`` and ``terminate(grace=...)``
take a shorter one (a hung job has nothing to save).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Sequence

from dtrain.errors import SpecError
from dtrain.launch.backends.base import Backend, DryRunRequest, JobHandle, JobStatus
from dtrain.launch.engine.job import Job
from dtrain.launch.engine.placement import Placement
from dtrain.launch.engine.processes import AgentLogs, NodeSupervisor
from dtrain.launch.engine.torchrun import C10d, agent_argv

LOOPBACK = "127.0.0.1"


class LocalBackend(Backend):
    """Nodes simulated on this host: one torchrun agent per node, c10d on loopback."""

    name = "local"
    description = "every node simulated on this host (one torchrun agent each)"
    install_hint = "pip install 'airflow-dtrain[torch]'"
    single_host = True
    carries_secret_env = True  # the agents' process environment

    def __init__(self, sink=None, python: str | None = None, grace_seconds: float | None = None):
        super().__init__(**({"sink": sink} if sink else {}))
        self.python = python or sys.executable
        #: seconds between SIGTERM and SIGKILL on a stop; None: the spec's stop_grace (set at submit)
        self.grace_seconds = grace_seconds
        self.supervisor = NodeSupervisor(self.sink, grace_seconds=5.0 if grace_seconds is None else grace_seconds)

    @classmethod
    def runner(cls, distribution: str) -> str:
        return "mpi" if distribution == "mpi" else cls.name  # mpirun starts the ranks itself

    @classmethod
    def node_commands(cls, placement: Placement, python_args: Sequence[str]) -> list[tuple[str, list[str]]]:
        return [("localhost", [sys.executable, *python_args]) for _ in range(placement.nodes)]

    def dryrun(self, job: Job, *, detached: bool = False) -> DryRunRequest:
        if detached:
            raise SpecError("deferrable", True, "a backend whose jobs outlive the worker (not 'local': its "
                                                "agents are children of the task)")
        spec = job.spec
        port = self.free_port(spec)
        argvs = tuple(tuple(agent_argv(spec, python=self.python, job_id=job.job_id,
                                       rdzv=C10d(LOOPBACK, port, is_host=i == 0)))
                      for i in range(spec.nodes))
        return DryRunRequest(backend=self.name, argvs=argvs, env=self.node_env(job, port=port))

    def submit(self, job: Job, *, detached: bool = False) -> JobHandle:
        request = self.dryrun(job, detached=detached)
        base_env = {**os.environ, **request.env}
        envs = [dict(base_env, DTRAIN_NODE_INDEX=str(i)) for i in range(len(request.argvs))]
        self.supervisor.job_id = job.job_id  # teardown also finds what left the tree
        self.supervisor.grace_seconds = self.stop_grace(job.spec)
        self.supervisor.stopping_sink = AgentLogs(job.run_dir)  # a stop's shutdown chatter: see NodeSupervisor
        self.supervisor.start(request.argvs, envs, cwd=job.spec.workdir)
        return JobHandle(backend=self.name, job_id=job.job_id, backend_job_id=job.job_id, run_dir=job.run_dir,
                         world_size=job.spec.world_size, submitted_at=time.time(),
                         data={"nodes": len(request.argvs)})

    def poll(self, handle: JobHandle) -> JobStatus:
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

    def terminate(self, grace: float | None = None) -> None:
        # Tear down here rather than only flagging run(): on_kill may be the last code the
        # task process runs before it is killed itself.
        super().terminate()
        self.supervisor.stop("terminate")
        self.supervisor.teardown(grace)

    def pids(self) -> set[int]:
        return self.supervisor.pids()
