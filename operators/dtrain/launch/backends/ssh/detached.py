"""Deferrable SSH jobs: start one detached torchrun agent per host, poll and stop them over ssh.

The blocking SSH backend keeps an ssh session per host open as a lifeline; a deferred
task cannot (its worker is gone while it waits), so here each host runs
:mod:`.detached_node`: ``start`` returns as soon as the node's daemon
runs, ``status`` reports it (running / exited with a code / lost), ``stop`` ends its
whole tree. Hosts, rendezvous, agent argv and the env (sent over stdin) are built with
the SSH backend's own functions, so both modes launch the same job.

Host entries and SSH settings travel to the trigger as primitives (hostfile lines and a
dict: paths of key files, never keys).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from dtrain.errors import LaunchError
from dtrain.launch.backends.base import JobStatus
from dtrain.launch.backends.ssh.hostfile import SSHSettings, coerce_hosts, ssh_argv

MODULE = "dtrain.launch.backends.ssh.detached_node"
#: seconds between SIGTERM and SIGKILL when the caller does not say (the backend passes the spec's
#: stop_grace, which it also renders into ``start --grace`` and keeps in the job handle)
DEFAULT_GRACE = 5.0


@dataclass(frozen=True)
class Target:
    """Where the nodes run: the hosts (hostfile lines), the SSH settings and the remote interpreter."""

    hosts: tuple[str, ...]
    ssh: dict[str, Any]

    def entries(self):
        return coerce_hosts(list(self.hosts))

    def settings(self) -> SSHSettings:
        return SSHSettings.from_mapping(self.ssh)

    @property
    def python(self) -> str:
        return self.settings().python or sys.executable


def node_command(python: str, verb: str, run_dir: str, node: int, *extra: str) -> str:
    """The one string a host's login shell runs: every word shlex-quoted."""
    return shlex.join([python, "-m", MODULE, verb, "--run-dir", run_dir, "--node", str(node), *extra])


def status_argvs(target: Target, run_dir: str) -> list[list[str]]:
    settings = target.settings()
    return [ssh_argv(settings, host, node_command(target.python, "status", run_dir, i))
            for i, host in enumerate(target.entries())]


def stop_argvs(target: Target, run_dir: str, grace: float = DEFAULT_GRACE) -> list[list[str]]:
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


def decide(nodes: Sequence[dict[str, Any]]) -> JobStatus:
    """Done when every node exited 0, or as soon as one node failed or was lost (the others
    are then stopped by whoever resumes the task). An unreachable host is not a verdict."""
    for node in nodes:
        if node["state"] == "exited" and node.get("exit_code"):
            return JobStatus("FAILED", True, int(node["exit_code"]), node.get("node"), f"node {node.get('node')}",
                             list(node.get("tail", [])))
        if node["state"] in ("lost", "unknown"):
            return JobStatus("LOST", True, 1, node.get("node"), f"node {node.get('node')}",
                             [f"node {node.get('node')}: the agent is gone without an exit record"]
                             + list(node.get("tail", [])))
    if all(node["state"] == "exited" for node in nodes):
        return JobStatus("COMPLETED", True, 0)
    unreachable = any(node["state"] == "unreachable" for node in nodes)
    tail = [line for node in nodes if node["state"] == "unreachable" for line in node.get("tail", [])]
    return JobStatus("RUNNING", False, tail=tail, reachable=not unreachable,
                     reason="; ".join(tail) if unreachable else "")


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


def start(target: Target, run_dir: str, argvs: Sequence[Sequence[str]], stdin: Sequence[str]) -> None:
    """Run every host's ``detached_node start`` (the backend's rendered ssh argvs); on any failure
    stop the nodes already started and raise with the failing host's output."""
    settings, hosts = target.settings(), target.entries()
    results = _parallel([list(a) for a in argvs], timeout=settings.connect_timeout + 60,
                        stdin=[line.encode() for line in stdin])
    failed = [(i, r) for i, r in enumerate(results) if r[0] != 0]
    if failed:
        stop_job(target, run_dir)
        i, (code, out, err) = failed[0]
        raise LaunchError(f"starting node {i} on {hosts[i].host} over ssh failed (exit {code})", code or 255,
                          tail=(out + err).strip().splitlines()[-20:])


def read_logs(run_dir: str, nodes: int, lines: int) -> list[str]:
    """The last lines of every node's log (in the shared run directory), node by node."""
    from dtrain.launch.backends.ssh.detached_node import paths
    from dtrain.launch.tailfile import read_tail

    out: list[str] = []
    for node in range(nodes):
        out += [f"[node{node}] {line}" for line in read_tail(paths(run_dir, node)["log"], lines)]
    return out[-lines:]


def query_job(target: Target, run_dir: str) -> JobStatus:
    argvs = status_argvs(target, run_dir)
    results = _parallel(argvs, timeout=target.settings().connect_timeout + 30)
    return decide([parse_status(i, *r) for i, r in enumerate(results)])


def stop_job(target: Target, run_dir: str, grace: float = DEFAULT_GRACE) -> list[dict[str, Any]]:
    """Stop every host's node (idempotent: a node already ended is left as it is)."""
    results = _parallel(stop_argvs(target, run_dir, grace), timeout=target.settings().connect_timeout + grace + 30)
    return [parse_status(i, *r) for i, r in enumerate(results)]
