"""A toy backend, as a third party would write one: one file, one entry-point line.

It starts every rank itself (no torchrun), each through dtrain's per-rank wrapper, in a
session of its own, and keeps what a poll needs in the run directory (the ranks' pids with
their start times; the wrapper's exit records), so any process can poll or cancel a job
from its handle: it supports detached (deferrable) submission.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from dtrain.launch.backends import Backend, DryRunRequest, JobHandle, JobStatus
from dtrain.launch.core.torchrun import RANK_ENTRY


def _records(run_dir: str) -> dict[int, dict]:
    out = {}
    exits = os.path.join(run_dir, "exits")
    for name in os.listdir(exits) if os.path.isdir(exits) else []:
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(exits, name), encoding="utf-8") as fh:
                record = json.load(fh)
            out[record["rank"]] = record
    return out


class ToyBackend(Backend):
    name = "toy"
    description = "every rank started directly on this host (a test backend)"
    single_host = True
    supports_detached = True

    def __init__(self, sink=None):
        super().__init__(**({"sink": sink} if sink else {}))
        self._procs: list[subprocess.Popen] = []

    @classmethod
    def node_commands(cls, spec, python_args):
        return [("localhost", [sys.executable, *python_args]) for _ in range(spec.nodes)]

    def dryrun(self, job, *, detached=False):
        spec = job.spec
        port = self.free_port(spec)
        argvs, envs = [], []
        for rank in range(spec.world_size):
            argvs.append((sys.executable, *RANK_ENTRY, *spec.command))
            envs.append({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(spec.world_size),
                         "RANK": str(rank), "LOCAL_RANK": str(rank % spec.procs_per_node),
                         "LOCAL_WORLD_SIZE": str(spec.procs_per_node), "NODE_RANK": str(rank // spec.procs_per_node)})
        # the contract's node environment; each rank's node index comes from its NODE_RANK
        return DryRunRequest(backend=self.name, argvs=tuple(argvs), env=self.node_env(job, port=port),
                             stdin=tuple(json.dumps(env, sort_keys=True) for env in envs))

    def submit(self, job, *, detached=False):
        request = self.dryrun(job, detached=detached)
        ranks = []
        for argv, rank_env in zip(request.argvs, request.stdin):
            env = {**os.environ, **request.env, **json.loads(rank_env)}
            proc = subprocess.Popen(list(argv), env=env, cwd=job.spec.workdir, start_new_session=True,
                                    stdout=None if detached else subprocess.DEVNULL, stderr=subprocess.STDOUT)
            self._procs.append(proc)
            ranks.append([proc.pid, psutil.Process(proc.pid).create_time()])
        state = os.path.join(job.run_dir, "toy-ranks.json")
        with open(state + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(ranks, fh)
        os.replace(state + ".tmp", state)
        return JobHandle(backend=self.name, job_id=job.job_id, backend_job_id=job.job_id, run_dir=job.run_dir,
                         world_size=job.spec.world_size, submitted_at=time.time(), data={"poll_interval": 0.2})

    def _alive(self, handle):
        with open(os.path.join(handle.run_dir, "toy-ranks.json"), encoding="utf-8") as fh:
            ranks = json.load(fh)
        alive = []
        for pid, started in ranks:
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                continue
        return alive

    def poll(self, handle):
        for proc in self._procs:
            proc.poll()  # reap our own children
        records = _records(handle.run_dir)
        failed = sorted((r for r in records.values() if r["exit_code"] and not r["stopped_by_signal"]),
                        key=lambda r: r["time"])
        if failed:
            return JobStatus("FAILED", True, failed[0]["exit_code"], failed[0]["node_rank"], tail=failed[0]["tail"])
        if len(records) == handle.world_size:
            code = max((r["exit_code"] for r in records.values()), default=0)
            return JobStatus("COMPLETED" if code == 0 else "CANCELLED", True, code)
        if not self._alive(handle):
            return JobStatus("LOST", True, 1, reason="every rank is gone, some without an exit record")
        return JobStatus("RUNNING", False)

    def cancel(self, handle, grace=None):
        from dtrain.launch.node.proctree import kill_job

        self._stop_ranks(handle, 5.0 if grace is None else grace)
        kill_job(handle.job_id, 5.0)  # what the ranks started outside their sessions

    def release(self, handle):
        from dtrain.launch.node.proctree import kill_job

        kill_job(handle.job_id, 5.0)  # a finished job leaves nothing behind either

    def _stop_ranks(self, handle, grace):
        alive = self._alive(handle)
        for proc in alive:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        _, left = psutil.wait_procs(alive, timeout=grace)
        for proc in left:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        psutil.wait_procs(left, timeout=5)
        for proc in self._procs:
            proc.poll()

    def logs(self, handle, lines=40):
        return [line for r in _records(handle.run_dir).values() for line in r["tail"]][-lines:]

    def terminate(self, grace=None):
        super().terminate(grace)
