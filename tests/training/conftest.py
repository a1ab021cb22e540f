"""Real multi-process gloo jobs for the checkpoint tests, stopped by a finalizer whatever happens.

Each rank is started as torchrun starts it (the env contract: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), in its own session, so a test can kill one rank or all of them at a
chosen moment, which torchrun's agent would turn into a restart or a teardown of its own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.staging.conftest import s3  # noqa: F401 (a bucket on the suite's moto server, for the s3:// tests)

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One job: ``world`` rank processes of ``script`` with ``args``."""

    def __init__(self, script: str, args: list[str], world: int, log_dir: str):
        port = free_port()
        self.procs = []
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(world), "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            log = open(os.path.join(log_dir, f"rank{rank}.log"), "ab")
            self.procs.append(subprocess.Popen([sys.executable, os.path.join(SCRIPTS, script), *args], env=env,
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        self.log_dir = log_dir

    def wait(self, timeout: float = 120) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

    def kill(self, *ranks: int) -> None:
        for rank in ranks or range(len(self.procs)):
            proc = self.procs[rank]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def logs(self) -> str:
        return "\n".join(open(os.path.join(self.log_dir, f"rank{r}.log"), errors="replace").read()[-3000:]
                         for r in range(len(self.procs)))


@pytest.fixture
def jobs(request, tmp_path):
    """Start jobs with ``jobs(script, args, world)``; every one is killed when the test ends."""
    started: list[Job] = []

    def start(script: str, args: list[str], world: int) -> Job:
        log_dir = tmp_path / f"job{len(started)}"
        log_dir.mkdir()
        job = Job(script, [str(a) for a in args], world, str(log_dir))
        started.append(job)
        return job

    request.addfinalizer(lambda: [job.kill() for job in started])
    return start
