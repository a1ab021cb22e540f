"""Deferrable SSH jobs: start one detached torchrun agent per host, poll and stop them over ssh.

The blocking SSH backend keeps an ssh session per host open as a lifeline; a deferred
task cannot (its worker is gone while it waits), so here each host runs
:mod:`operators.launch.detached_node`: ``start`` returns as soon as the node's daemon
runs, ``status`` reports it (running / exited with a code / lost), ``stop`` ends its
whole tree. Hosts, rendezvous, agent argv and the env (sent over stdin) are built with
the SSH backend's own functions, so both modes launch the same job.

Host entries and SSH settings travel to the trigger as primitives (hostfile lines and a
dict: paths of key files, never keys).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from operators.errors import LaunchError
from operators.launch.job import Job

MODULE = "operators.launch.detached_node"


@dataclass(frozen=True)
class Target:
    """Where the nodes run: the hosts (hostfile lines), the SSH settings and the remote interpreter."""

    hosts: tuple[str, ...]
    ssh: dict[str, Any]

    def entries(self):
        from operators.launch.hostfile import coerce_hosts

        return coerce_hosts(list(self.hosts))

    def settings(self):
        from operators.launch.hostfile import SSHSettings

        return SSHSettings.from_mapping(self.ssh)

    @property
    def python(self) -> str:
        return self.settings().python or sys.executable


def target_of(job: Job) -> Target:
    return Target(hosts=tuple(str(h) for h in job.spec.resolved_hosts), ssh=dict(job.spec.ssh or {}))


def node_command(python: str, verb: str, run_dir: str, node: int, *extra: str) -> str:
    """The one string a host's login shell runs: every word shlex-quoted."""
    return shlex.join([python, "-m", MODULE, verb, "--run-dir", run_dir, "--node", str(node), *extra])


def status_argvs(target: Target, run_dir: str) -> list[list[str]]:
    from operators.launch.backends.ssh import ssh_argv

    settings = target.settings()
    return [ssh_argv(settings, host, node_command(target.python, "status", run_dir, i))
            for i, host in enumerate(target.entries())]


def stop_argvs(target: Target, run_dir: str, grace: float = 5.0) -> list[list[str]]:
    from operators.launch.backends.ssh import ssh_argv

    settings = target.settings()
    return [ssh_argv(settings, host, node_command(target.python, "stop", run_dir, i, "--grace", f"{grace:g}"))
            for i, host in enumerate(target.entries())]


def parse_status(index: int, returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    """One host's ``status`` answer; an ssh failure is reported as such (the trigger retries it)."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "state" in data:
            return data
    return {"node": index, "state": "unreachable", "exit_code": None,
            "tail": [f"ssh exit {returncode}: {stderr.strip()[-500:]}"]}


@dataclass(frozen=True)
class SSHJobStatus:
    done: bool
    ok: bool
    exit_code: int | None
    state: str
    failed_node: int | None
    tail: list[str]
    unreachable: bool = False


def decide(nodes: Sequence[dict[str, Any]]) -> SSHJobStatus:
    """Done when every node exited 0, or as soon as one node failed or was lost (the others
    are then stopped by whoever resumes the task). An unreachable host is not a verdict."""
    for node in nodes:
        if node["state"] == "exited" and node.get("exit_code"):
            return SSHJobStatus(True, False, int(node["exit_code"]), "FAILED", node.get("node"), node.get("tail", []))
        if node["state"] in ("lost", "unknown"):
            return SSHJobStatus(True, False, 1, "LOST", node.get("node"),
                                [f"node {node.get('node')}: the agent is gone without an exit record"]
                                + list(node.get("tail", [])))
    if all(node["state"] == "exited" for node in nodes):
        return SSHJobStatus(True, True, 0, "COMPLETED", None, [])
    unreachable = any(node["state"] == "unreachable" for node in nodes)
    tail = [line for node in nodes if node["state"] == "unreachable" for line in node.get("tail", [])]
    return SSHJobStatus(False, False, None, "RUNNING", None, tail, unreachable=unreachable)


def _parallel(argvs: Sequence[list[str]], timeout: float, stdin: Sequence[bytes] | None = None) -> list[tuple[int, str, str]]:
    results: list[tuple[int, str, str]] = [(255, "", "not run")] * len(argvs)

    def one(i: int) -> None:
        try:
            done = subprocess.run(argvs[i], input=None if stdin is None else stdin[i],
                                  stdin=subprocess.DEVNULL if stdin is None else None,
                                  capture_output=True, timeout=timeout)
            results[i] = (done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))
        except subprocess.TimeoutExpired:
            results[i] = (255, "", f"timed out after {timeout:.0f}s")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(argvs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def start_job(job: Job, sink: Callable[[str], None] = print) -> Target:
    """Start every host's detached agent; on any failure stop those already started and raise."""
    from operators.launch.backends.ssh import SSHBackend, probe_port, ssh_argv, static_agent_argv

    spec = job.spec
    target = target_of(job)
    settings, hosts, python = target.settings(), target.entries(), target.python
    port = spec.rdzv_port or probe_port(settings, hosts[0], python)
    env_builder = SSHBackend(sink=sink)
    env_builder.hosts = hosts  # node_env reads the host list (loopback hosts, TF_CONFIG)
    workdir = spec.workdir or os.getcwd()
    argvs, payloads = [], []
    for i, host in enumerate(hosts):
        agent = static_agent_argv(spec, python=python, node_index=i, rdzv_host=hosts[0].address, rdzv_port=port,
                                  job_id=job.job_id)
        command = node_command(python, "start", job.run_dir, i, "--job-id", job.job_id, "--workdir", workdir,
                               "--", *agent)
        argvs.append(ssh_argv(settings, host, command))
        payloads.append((json.dumps({"env": env_builder.node_env(job, i, port)}) + "\n").encode())
    results = _parallel(argvs, timeout=settings.connect_timeout + 60, stdin=payloads)
    failed = [(i, r) for i, r in enumerate(results) if r[0] != 0]
    if failed:
        stop_job(target, job.run_dir)
        i, (code, out, err) = failed[0]
        raise LaunchError(f"starting node {i} on {hosts[i].host} over ssh failed (exit {code})", code or 255,
                          tail=(out + err).strip().splitlines()[-20:])
    sink(f"[dtrain] ssh (detached): {len(hosts)} host(s) {', '.join(h.host for h in hosts)}; "
         f"rendezvous {hosts[0].address}:{port}; logs in {os.path.join(job.run_dir, 'detached')}")
    return target


def query_job(target: Target, run_dir: str) -> SSHJobStatus:
    argvs = status_argvs(target, run_dir)
    results = _parallel(argvs, timeout=target.settings().connect_timeout + 30)
    return decide([parse_status(i, *r) for i, r in enumerate(results)])


def stop_job(target: Target, run_dir: str, grace: float = 5.0) -> list[dict[str, Any]]:
    """Stop every host's node (idempotent: a node already ended is left as it is)."""
    results = _parallel(stop_argvs(target, run_dir, grace), timeout=target.settings().connect_timeout + grace + 30)
    return [parse_status(i, *r) for i, r in enumerate(results)]
