"""Local backend: every node simulated on this host, one torchrun agent each.

c10d rendezvous on 127.0.0.1 at a port chosen per job; each agent in its own
process group; teardown of every rank on any failure, stop, or signal.
"""

from __future__ import annotations

import os
import sys

from operators.launch.backends.base import Backend, BackendOutcome
from operators.launch.job import Job, free_port
from operators.launch.processes import NodeSupervisor
from operators.launch.torchrun import agent_argv

LOOPBACK = "127.0.0.1"


class LocalBackend(Backend):
    name = "local"

    def __init__(self, sink=None, python: str | None = None, grace_seconds: float = 5.0):
        super().__init__(**({"sink": sink} if sink else {}))
        self.python = python or sys.executable
        self.supervisor = NodeSupervisor(self.sink, grace_seconds=grace_seconds)

    def run(self, job: Job) -> BackendOutcome:
        spec = job.spec
        port = spec.rdzv_port or free_port(LOOPBACK)
        argvs = [
            agent_argv(spec, python=self.python, node_index=i, rdzv_host=LOOPBACK, rdzv_port=port, job_id=job.job_id)
            for i in range(spec.nodes)
        ]
        base_env = dict(os.environ)
        # Simulated nodes talk over loopback whatever the host's interfaces are.
        base_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        base_env.update(job.rank_env)
        envs = [dict(base_env, DTRAIN_NODE_INDEX=str(i)) for i in range(spec.nodes)]
        try:
            self.supervisor.start(argvs, envs, cwd=spec.workdir)
            code, node = self.supervisor.wait(expected=spec.nodes)
        finally:
            self.supervisor.teardown()
        if code == -1:
            return BackendOutcome(exit_code=-1, stopped=True)
        return BackendOutcome(exit_code=code, node_index=None if node is None else node.index,
                              tail=[] if node is None else list(node.tail))

    def terminate(self) -> None:
        # Tear down here rather than only flagging run(): on_kill may be the last code the
        # task process runs before it is killed itself.
        self.supervisor.stop("terminate")
        self.supervisor.teardown()

    def pids(self) -> set[int]:
        return self.supervisor.pids()
