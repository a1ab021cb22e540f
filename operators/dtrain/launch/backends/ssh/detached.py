"""Deferrable SSH jobs: start one detached torchrun agent per host, watch them, stop them.

The blocking SSH backend keeps an ssh session per host open as a lifeline; a deferred
task cannot (its worker is gone while it waits), so here each host runs
:mod:`.detached_node`: ``start`` returns as soon as the node's daemon
runs, ``status`` reports it (running / exited with a code / lost), ``stop`` ends its
whole tree. Hosts, rendezvous, agent argv and the env (sent over stdin) are built with
the SSH backend's own functions, so both modes launch the same job.

Watching costs the triggerer no process per host: each node's daemon keeps a heartbeat and
writes its exit record in the shared run directory, which a poll reads
(:func:`shared_statuses`); only a node whose heartbeat is stale is asked over ssh, through a
reused connection (:mod:`.control`). Every ssh action runs at most ``fanout`` clients at once
(:mod:`.fanout`).

Host entries and SSH settings travel to the trigger as primitives (hostfile lines and a
dict: paths of key files, never keys), with the job's id and secret: the secret keys the MAC
of the daemons' records (:mod:`dtrain.launch.node.records`) and reaches a host only on an ssh session's stdin.
A record that is not believed, a PID a host refused to signal, is handed to ``warn``.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from dtrain.errors import LaunchError
from dtrain.launch.backends.base import JobStatus
from dtrain.launch.backends.ssh import control
from dtrain.launch.backends.ssh.detached_node import (MODULE, STATES, TAIL_LINES, beat_age,
                                                      log_tail, status_from_files)
from dtrain.launch.backends.ssh.fanout import run_bounded, run_bounded_async
from dtrain.launch.backends.ssh.hostfile import HostEntry, SSHSettings, coerce_hosts, ssh_argv
from dtrain.launch.core.lost import PROBE_TIMEOUT_S, LostNode, fault_of
from dtrain.launch.node.lease import HEARTBEAT_S, LOST_EXIT_CODE, STALE_BEATS
from dtrain.launch.node.records import FENCE_REASON_LIMIT, FIELDS, JobKey
from dtrain.rundir import RunDir

Warn = Callable[[str], Any]
#: seconds between SIGTERM and SIGKILL when the caller does not say (the backend passes the spec's
#: stop_grace, which it also renders into ``start --grace`` and keeps in the job handle)
DEFAULT_GRACE = 5.0


@dataclass(frozen=True)
class Target:
    """The job's nodes: where they run (host entries, the SSH settings, the remote interpreter),
    the job's id, and its secret ("" when the caller has none: a task resumed from an event, which
    may stop the job but believes no exit record). Built once per job (:meth:`of_handle`), typed:
    a poll parses nothing."""

    hosts: tuple[HostEntry, ...]
    settings: SSHSettings
    job_id: str
    secret: str = field(default="", repr=False)

    @classmethod
    def of_handle(cls, hosts: Sequence[str], ssh: Mapping[str, Any], job_id: str, secret: str = "") -> "Target":
        """From a job handle's primitives (hostfile lines, the settings' mapping), checked once here."""
        return cls(hosts=tuple(coerce_hosts(list(hosts))), settings=SSHSettings.from_mapping(dict(ssh)),
                   job_id=job_id, secret=secret)

    def key(self) -> JobKey | None:
        return JobKey(self.job_id, self.secret) if self.secret else None

    def stdin(self) -> bytes | None:
        """What a ``status``/``stop`` reads on stdin: the secret, if there is one."""
        return (json.dumps({"secret": self.secret}) + "\n").encode() if self.secret else None

    @property
    def python(self) -> str:
        return self.settings.python or sys.executable


def node_command(python: str, verb: str, run_dir: str, node: int, *extra: str) -> str:
    """The one string a host's login shell runs: every word shlex-quoted."""
    return shlex.join([python, "-m", MODULE, verb, "--run-dir", run_dir, "--node", str(node), *extra])


def lease_options(hosts: Sequence[HostEntry], node: int, settings: SSHSettings) -> list[str]:
    """``detached_node start``'s lease: the node fences itself after ``lost_after`` seconds cut off
    from its peer (node 0's login port; node 0's own peer is node 1) or frozen. A job of one node
    has no peer: it fences only after being frozen that long."""
    options = ["--lease", f"{settings.lost_after:g}"]
    if len(hosts) > 1:
        peer = hosts[1 if node == 0 else 0]
        options += ["--peer", f"{peer.host}:{settings.login_port(peer)}"]  # host: an IPv6 literal keeps its brackets
    return options


def status_argvs(target: Target, run_dir: str, indexes: Sequence[int] | None = None,
                 mux_dir: str | None = None) -> list[list[str]]:
    """``detached_node status`` over ssh for the nodes ``indexes`` (default: all), reusing
    connections through ``mux_dir``'s masters when given (:mod:`.control`)."""
    settings, entries = target.settings, target.hosts
    chosen = range(len(entries)) if indexes is None else indexes
    return [ssh_argv(settings, entries[i], node_command(target.python, "status", run_dir, i, "--job-id", target.job_id),
                     _mux(mux_dir, i))
            for i in chosen]


def stop_argvs(target: Target, run_dir: str, grace: float = DEFAULT_GRACE, mux_dir: str | None = None) -> list[list[str]]:
    settings = target.settings
    return [ssh_argv(settings, host, node_command(target.python, "stop", run_dir, i, "--job-id", target.job_id,
                                                  "--grace", f"{grace:g}"), _mux(mux_dir, i))
            for i, host in enumerate(target.hosts)]


def _mux(mux_dir: str | None, node: int) -> list[str]:
    if mux_dir is None:
        return []
    control.ensure(mux_dir)  # only now: a poll that needs no ssh leaves nothing behind
    return control.mux_options(control.socket_path(mux_dir, node))


def close_argvs(target: Target, mux_dir: str) -> list[list[str]]:
    """``ssh -O exit`` for every master the job left in ``mux_dir`` (no handshake: the socket only)."""
    entries = target.hosts
    return [["ssh", "-o", f"ControlPath={control.socket_path(mux_dir, i)}", "-O", "exit", "--", entries[i].address]
            for i in control.live_sockets(mux_dir) if i < len(entries)]


def parse_status(index: int, returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    """One host's ``status`` answer, checked field by field; an ssh failure, or an answer that is
    not one, is reported as an unreachable host (not a verdict: the trigger asks again)."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(data, dict) and "state" in data:
            answer = checked_answer(index, data)
            if answer is not None:
                return answer
            stderr = f"an answer that is not a node status: {line[:200]!r}"
            break
    return {"node": index, "state": "unreachable", "exit_code": None,
            "tail": [f"ssh exit {returncode}: {stderr.strip()[-500:]}"], "ignored": []}


def _texts(value: Any, limit: int) -> list[str] | None:
    if isinstance(value, list) and len(value) <= limit and all(isinstance(v, str) for v in value):
        return value
    return None


def checked_answer(index: int, data: dict[str, Any]) -> dict[str, Any] | None:
    """A node status as :func:`detached_node.status` prints it, or None: the state one of STATES,
    an exit code (as an exit record holds it) exactly when it exited, lines of text."""
    state, code = data.get("state"), data.get("exit_code")
    tail, ignored = _texts(data.get("tail", []), 10 * TAIL_LINES), _texts(data.get("ignored", []), 100)
    if state not in STATES or tail is None or ignored is None:
        return None
    if (state == "exited") != (code is not None) or not (code is None or FIELDS["exit"]["exit_code"](code)):
        return None
    fenced = data.get("fenced")
    if not (fenced is None or isinstance(fenced, str) and len(fenced) <= FENCE_REASON_LIMIT):
        return None
    return {"node": index, "state": state, "exit_code": code, "fenced": fenced, "tail": tail, "ignored": ignored}


def decide(nodes: Sequence[dict[str, Any]], lost: LostNode | None = None) -> JobStatus:
    """Done when every node exited 0, or as soon as one node failed or was lost (the others
    are then stopped by whoever resumes the task). ``lost`` (:func:`lost_node_of`) comes first: the
    failures of the nodes it left behind are not the cause. An unreachable host is not a verdict
    by itself. Records that were not believed are named in a failure's last lines."""
    if lost is not None:
        node = nodes[lost.node]
        return JobStatus("LOST", True, LOST_EXIT_CODE, lost.node, lost.message(),
                         [lost.message()] + node["ignored"] + node["tail"], lost=lost.to_dict())
    for node in nodes:
        index = node["node"]
        if node["state"] == "exited" and node["exit_code"]:
            return JobStatus("FAILED", True, node["exit_code"], index, f"node {index}",
                             node["ignored"] + node["tail"])
        if node["state"] in ("lost", "unknown"):
            return JobStatus("LOST", True, 1, index, f"node {index}",
                             [f"node {index}: the agent is gone without an exit record"] + node["ignored"] + node["tail"])
    if all(node["state"] == "exited" for node in nodes):
        return JobStatus("COMPLETED", True, 0)
    unreachable = any(node["state"] == "unreachable" for node in nodes)
    tail = [line for node in nodes if node["state"] == "unreachable" for line in node.get("tail", [])]
    return JobStatus("RUNNING", False, tail=tail, reachable=not unreachable,
                     reason="; ".join(tail) if unreachable else "")


def start(target: Target, run_dir: str, argvs: Sequence[Sequence[str]], stdin: Sequence[str]) -> None:
    """Run every host's ``detached_node start`` (the backend's rendered ssh argvs), ``fanout`` at a
    time; after a failure no further host is started, the started ones are stopped, and the
    error names every host that failed."""
    settings, hosts = target.settings, target.hosts
    results = run_bounded([list(a) for a in argvs], limit=settings.fanout, timeout=settings.connect_timeout + 60,
                          stdin=[line.encode() for line in stdin], stop_on_failure=True)
    failed = [(i, r) for i, r in enumerate(results) if r[0] not in (0, None)]
    if failed:
        started = sum(1 for r in results if r[0] == 0)
        skipped = sum(1 for r in results if r[0] is None)
        stop_job(target, run_dir)
        names = ", ".join(f"node {i} on {hosts[i].label} (exit {r[0]})" for i, r in failed)
        i, (code, out, err) = failed[0]
        raise LaunchError(f"starting {len(failed)} of {len(hosts)} node(s) over ssh failed: {names}; "
                          f"stopped the {started} started, did not start {skipped}", code or 255,
                          tail=(out + err).strip().splitlines()[-20:])


def read_logs(run_dir: str, nodes: int, lines: int) -> list[str]:
    """The last lines of every node's log (in the shared run directory), node by node."""
    files = RunDir(run_dir)
    out: list[str] = []
    for node in range(nodes):
        out += [f"[node{node}] {line}" for line in log_tail(files, node, lines)]
    return out[-lines:]


def stale_after() -> float:
    return STALE_BEATS * HEARTBEAT_S


def shared_statuses(target: Target, run_dir: str, now: float | None = None) -> list[dict[str, Any] | None]:
    """Every node's status as the shared filesystem tells it; None where only its host can tell."""
    now = time.time() if now is None else now
    key = target.key()
    return [status_from_files(run_dir, i, now, stale_after(), key=key) for i in range(len(target.hosts))]


def merge(shared: Sequence[dict[str, Any] | None], asked: Sequence[int],
          results: Sequence[tuple]) -> list[dict[str, Any]]:
    """The shared-filesystem statuses with the ssh answers for the ``asked`` nodes put in."""
    merged = list(shared)
    for i, result in zip(asked, results):
        merged[i] = parse_status(i, *result)
    return merged


def report(nodes: Sequence[dict[str, Any]], warn: Warn | None) -> list[dict[str, Any]]:
    """Hand every record a node ignored (or PID it refused) to ``warn``; return ``nodes``."""
    for node in nodes:
        for note in node["ignored"] if warn else ():
            warn(f"[dtrain] {note}")
    return list(nodes)


def lost_node_of(target: Target, run_dir: str, nodes: Sequence[dict[str, Any]], now: float | None = None) -> LostNode | None:
    """The node the job lost, when this poll shows a sign of one: a node fenced itself (it could not
    reach its peer, or was frozen, for the lease), a node failed (its peers' ranks fail when one host
    crashes), or a node's heartbeat is stale and its host does not answer over ssh. Then every node
    that did not end well has its login port probed (in parallel, a few seconds at most): the first
    that shows a fault (:func:`dtrain.launch.core.lost.fault_of`) is the lost one, except that a
    host that merely does not answer while nothing else went wrong is lost only once its heartbeat is
    older than the lease (``lost_after``: a network blip is not a lost node); if none is, the first
    fenced node, with its own reason. None: no node was lost."""
    now = time.time() if now is None else now
    lease = target.settings.lost_after
    fenced = [node for node in nodes if node.get("fenced")]
    failed = any(node["state"] == "exited" and node["exit_code"] for node in nodes)
    silent = {node["node"]: beat_age(run_dir, node["node"], now) or float("inf")
              for node in nodes if node["state"] == "unreachable"}  # a stale heartbeat, and ssh got no answer
    if not (fenced or failed or silent):
        return None
    suspects = [node["node"] for node in nodes if not (node["state"] == "exited" and node["exit_code"] == 0)]
    faults = probe_hosts(target, suspects)
    for index, fault in zip(suspects, faults):
        # "gone" and "frozen" are certain at once; no answer at all may be a blip until the lease is over
        if fault is not None and (fault[0] != "unreachable" or fenced or failed or silent.get(index, 0.0) >= lease):
            return LostNode(index, target.hosts[index].address, *fault)
    if fenced:
        return LostNode(fenced[0]["node"], target.hosts[fenced[0]["node"]].address, "unreachable", fenced[0]["fenced"])
    return None


def probe_hosts(target: Target, indexes: Sequence[int]) -> list[tuple[str, str] | None]:
    """:func:`fault_of` for each node's login port, ``fanout`` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    settings = target.settings
    timeout = min(PROBE_TIMEOUT_S, settings.connect_timeout)

    def look(index: int) -> tuple[str, str] | None:
        host = target.hosts[index]
        return fault_of(host.address, settings.login_port(host), timeout)

    if not indexes:
        return []
    with ThreadPoolExecutor(max_workers=min(settings.fanout, len(indexes))) as pool:
        return list(pool.map(look, indexes))


def query_job(target: Target, run_dir: str, warn: Warn | None = None) -> JobStatus:
    """The job's status: the shared filesystem first, ssh only for nodes with a stale heartbeat."""
    shared = shared_statuses(target, run_dir)
    asked = [i for i, status in enumerate(shared) if status is None]
    settings = target.settings
    results = run_bounded(status_argvs(target, run_dir, asked), limit=settings.fanout,
                          timeout=settings.connect_timeout + 30, stdin=[target.stdin()] * len(asked))
    nodes = report(merge(shared, asked, results), warn)
    return decide(nodes, lost_node_of(target, run_dir, nodes))


async def async_query_job(target: Target, run_dir: str, mux_dir: str | None = None,
                          warn: Warn | None = None) -> tuple[JobStatus, list[int]]:
    """:func:`query_job` for the triggerer: file reads in a thread, ssh calls bounded and reusing
    connections; also returns the nodes it asked over ssh."""
    import asyncio

    shared = await asyncio.to_thread(shared_statuses, target, run_dir)
    asked = [i for i, status in enumerate(shared) if status is None]
    settings = target.settings
    results = await run_bounded_async(status_argvs(target, run_dir, asked, mux_dir), limit=settings.fanout,
                                      timeout=settings.connect_timeout + 30, stdin=[target.stdin()] * len(asked))
    nodes = report(merge(shared, asked, results), warn)
    return decide(nodes, await asyncio.to_thread(lost_node_of, target, run_dir, nodes)), asked


def stop_job(target: Target, run_dir: str, grace: float = DEFAULT_GRACE, warn: Warn | None = None) -> list[dict[str, Any]]:
    """Stop every host's node (idempotent: a node already ended is left as it is)."""
    settings = target.settings
    results = run_bounded(stop_argvs(target, run_dir, grace), limit=settings.fanout,
                          timeout=settings.connect_timeout + grace + 30, stdin=[target.stdin()] * len(target.hosts))
    return _stopped(target, results, warn)


async def async_stop_job(target: Target, run_dir: str, grace: float, mux_dir: str | None = None,
                         warn: Warn | None = None) -> list[dict[str, Any]]:
    """:func:`stop_job` for the triggerer, reusing connections through ``mux_dir``."""
    settings = target.settings
    results = await run_bounded_async(stop_argvs(target, run_dir, grace, mux_dir), limit=settings.fanout,
                                      timeout=settings.connect_timeout + grace + 30,
                                      stdin=[target.stdin()] * len(target.hosts))
    return _stopped(target, results, warn)


def _stopped(target: Target, results: Sequence[tuple], warn: Warn | None) -> list[dict[str, Any]]:
    """The hosts' answers to ``stop``; a host that could not be asked, and what a host ignored or
    refused, go to ``warn``."""
    for rc, _, err in results if warn else ():
        if rc != 0:
            warn(f"[dtrain] stopping ssh job {target.job_id}: {err.strip()}")
    return report([parse_status(i, *r) for i, r in enumerate(results)], warn)
