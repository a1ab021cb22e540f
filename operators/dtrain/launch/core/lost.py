"""A lost node: which one, at which address, and what kind of fault, for the verdict a launch ends with.

A backend that loses its connection to a node (the ssh client's keepalive got no answer, or the
connection closed under it) asks the host's login port what happened, once, in a few seconds:

* ``gone``: the port refuses or resets connections: the host's processes are gone (it crashed and
  its kernel still answers, or it rebooted);
* ``frozen``: the kernel completes the TCP handshake but nobody speaks (no SSH banner within the
  probe's time; a connection reset or closed before the banner is ``gone``): the host's
  processes are stopped (a frozen VM or cgroup, a machine swapping itself to death). On a real
  machine whose kernel is frozen too this looks like ``unreachable``;
* ``unreachable``: no answer at all within the probe's time (a partition: a cut cable, a dead
  switch port, a host that is off), or the host answers again now (a blip that outlasted the
  keepalive).

The job then ends with :data:`~dtrain.launch.node.lease.LOST_EXIT_CODE` (ssh's own code for a lost connection), which the
retry policy reads as a lost node (transient: the Airflow retry resumes from the last checkpoint).
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Collection, Sequence

from dtrain.launch.node.lease import BEAT, FENCE, HEARTBEAT_S, STALE_BEATS, beat_age, beat_name, fenced_name, read_fence
from dtrain.rundir import LEASE, RunDir

if TYPE_CHECKING:
    from dtrain.launch.node.records import JobKey

#: a node silent this long is lost (the ssh and slurm options' ``lost_after``): detection within it plus
#: the probe, the node's own fence within it plus the fence grace; both stay within 60 s
DEFAULT_LOST_AFTER_S = 30.0
#: below this a busy host (a long GC, a loaded link) would be declared lost
MIN_LOST_AFTER_S = 10.0
#: seconds the probe waits for the connection, then for the banner
PROBE_TIMEOUT_S = 5.0
FAULTS = ("unreachable", "frozen", "gone")


@dataclass(frozen=True)
class LostNode:
    node: int
    address: str
    fault: str  # one of FAULTS
    detail: str

    def message(self) -> str:
        return f"node {self.node} ({self.address}) lost: {self.fault} ({self.detail})"

    def to_dict(self) -> dict:
        return {**asdict(self), "message": self.message()}


def probe(address: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> tuple[str, str]:
    """(fault, detail) for a host whose connection was lost, from one look at its login port."""
    return fault_of(address, port, timeout) or ("unreachable", "the connection was lost; the host answers again now")


def handshake_fault(address: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> tuple[str, str] | None:
    """(fault, detail) when a TCP handshake with the port shows one of FAULTS' ``gone`` or
    ``unreachable``; None when it completes (nothing is sent: for a server that waits to be spoken
    to, such as slurmd, which a frozen host's kernel completes too)."""
    conn = _connect(address, port, timeout)
    if isinstance(conn, tuple):
        return conn
    conn.close()
    return None


def _connect(address: str, port: int, timeout: float) -> "socket.socket | tuple[str, str]":
    try:
        return socket.create_connection((address, port), timeout=timeout)
    except ConnectionRefusedError:
        return "gone", f"port {port} refuses connections: its processes are gone (crashed or rebooted)"
    except (ConnectionResetError, ConnectionAbortedError):
        # the host's kernel answered with a reset before the connection was ours: its server died with
        # the connection queued (the same race as below, lost during the handshake); nothing is cut off
        return "gone", f"port {port} resets connections: its processes are gone (crashed or rebooted)"
    except OSError as e:
        return "unreachable", f"no answer from {address}:{port} within {timeout:g} s ({e.strerror or e})"


def fault_of(address: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> tuple[str, str] | None:
    """(fault, detail) if the host's login port shows one of FAULTS, None when its server answers."""
    conn = _connect(address, port, timeout)
    if isinstance(conn, tuple):
        return conn
    with conn:
        conn.settimeout(timeout)
        try:
            banner = conn.recv(4)
        except TimeoutError:
            return "frozen", f"it accepts connections on port {port} but nothing answers within {timeout:g} s"
        except OSError:
            # reset: the kernel had queued the connection for a server that died before it spoke (a
            # crash killing the host's processes one by one: its sshd last); nothing is frozen
            banner = b""
    if not banner:
        return "gone", f"port {port} closes every connection at once"
    return None


def lost_node(node: int, address: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> LostNode:
    fault, detail = probe(address, port, timeout)
    return LostNode(node=node, address=address, fault=fault, detail=detail)


#: (address, port) -> (fault, detail) or None: how a watcher probes a node's daemon (handshake_fault, fault_of)
Probe = Callable[[str, int], "tuple[str, str] | None"]


#: how many distinct lease warnings a watcher keeps to tell each once (a rank could vary them without end)
TOLD_LIMIT = 256


class TellOnce:
    """A sink that passes each distinct line once: a watcher polls every second, a forged record stays."""

    def __init__(self, sink: Callable[[str], None]):
        self.sink, self.told = sink, set()

    def __call__(self, line: str) -> None:
        if line not in self.told and len(self.told) < TOLD_LIMIT:
            self.told.add(line)
            self.sink(line)


def _lease_records(files: RunDir, key: "JobKey | None", job_id: str, nodes: Collection[int], now: float,
                   report: Callable[[str], None]) -> tuple[dict[int, str], dict[int, float]]:
    """({node: fence reason}, {node: beat age}) from the records their holders wrote; each record that
    does not verify is reported, naming its file, and counts as none."""
    from dtrain.launch.node.records import RecordError

    fenced, ages = {}, {}
    for node in nodes:
        for kind, name, read, into in ((FENCE, fenced_name, lambda: read_fence(files, job_id, node, key), fenced),
                                       (BEAT, beat_name, lambda: beat_age(files, job_id, node, now, key), ages)):
            try:
                found = read()
            except RecordError as e:
                report(f"[dtrain] node {node}: refused the {kind} record {LEASE}/{job_id}/{name(node)}: {e}; "
                       "not its lease holder's (a rank can write the run directory)")
                continue
            if found is not None:
                into[node] = found
    return fenced, ages


def stale_after() -> float:
    """A node's heartbeat older than this is stale: only then is its host asked."""
    return STALE_BEATS * HEARTBEAT_S


def lost_by_leases(run_dir: str, job_id: str, nodes: int, lost_after: float, *, failed: bool,
                   hosts: Callable[[], Sequence[tuple[str, int]]], probe: Probe, silent_daemon: str | None,
                   key: "JobKey | None", report: Callable[[str], None] = lambda line: None,
                   now: float | None = None, exclude: Collection[int] = ()) -> LostNode | None:
    """The node job ``job_id`` lost, when its nodes' leases (:mod:`dtrain.launch.node.lease`) in the run
    directory show a sign of one; None otherwise. Two small bounded reads per node (its beat and fence
    records, each an HMAC to check) and a stat: cheap enough for every poll. The launcher's half of the lease, for every backend whose nodes hold one.

    A sign: a node fenced itself, a node's heartbeat is older than :func:`stale_after`, or the job
    ``failed`` (its heartbeats then stopped with it, so a stale one proves nothing). On a sign every
    node is probed (``probe(address, port)`` on ``hosts()``, in parallel; where the nodes are comes from
    the backend, never from the run directory, which the ranks can write), not only the ones that
    showed it: when node 1 is cut off or gone, node 0 fences itself too (it cannot reach node 1, its
    peer), and the verdict must name node 1:

    * ``gone`` or ``frozen`` from the probe is a verdict at once;
    * ``unreachable`` (no answer: a partition) only once a node fenced itself, the job failed, or the
      node's heartbeat is older than ``lost_after`` (a blip is not a lost node);
    * ``silent_daemon``: the name of the probed daemon when it speaks only when spoken to (slurmd), so
      that a probe cannot tell a frozen host from a live one: a handshake that completes to a host
      whose heartbeat is stale is then ``frozen`` (its kernel answers, its processes are stopped).
      None: the probe tells it (``fault_of`` waits for sshd's banner).

    ``key``: the job's lease key, with which the holders sign their records (Slurm); a record that does
    not verify counts as none, and is reported (``report``), naming its file. None: the holders sign
    nothing (mpi: the holder is a thread of a rank), so a record is only a hint.

    A node whose signed fence record says it fenced itself, while every node answers, is still lost
    (``unreachable``, with its own reason): it could not reach its peer, and its ranks are gone. An
    unsigned fence record the probe contradicts makes the node *suspect*: reported, not lost.

    ``exclude``: nodes not to look at (an elastic job's nodes already lost, or ended)."""
    now = time.time() if now is None else now
    files = RunDir(run_dir)
    fenced, ages = _lease_records(files, key, job_id, [i for i in range(nodes) if i not in exclude], now, report)
    stale = set() if failed else {i for i, age in ages.items() if age >= stale_after()}
    if not (fenced or stale or (failed and ages)):
        return None
    where = list(hosts())
    if len(where) != nodes:  # the backend cannot say where the nodes are (any more): nothing to probe
        return None
    with ThreadPoolExecutor(max_workers=min(32, nodes)) as pool:
        faults = list(pool.map(lambda i: probe(*where[i]), range(nodes)))
    for index, fault in enumerate(faults):
        if index in exclude:
            continue
        address, why = where[index][0], f"; it fenced itself: {fenced[index]}" if index in fenced else ""
        if fault is None and silent_daemon and index in stale:
            return LostNode(index, address, "frozen", f"its {silent_daemon} accepts connections but the node's heartbeat is "
                                                      f"{ages[index]:.0f} s old: its processes are stopped")
        if fault is not None and (fault[0] != "unreachable" or fenced or failed or ages.get(index, 0.0) >= lost_after):
            return LostNode(index, address, fault[0], fault[1] + why)
    if fenced and key is not None:
        index = min(fenced)
        return LostNode(index, where[index][0], "unreachable", f"it fenced itself: {fenced[index]}")
    for index in sorted(fenced):
        report(f"[dtrain] node {index} ({where[index][0]}) suspect: an unsigned fence record says it fenced itself "
               f"({fenced[index]}), but every node answers the probe: not declared lost")
    return None


def fenced(run_dir: str, job_id: str, node: int, key: "JobKey | None") -> bool:
    """Whether node ``node``'s lease holder recorded that it fenced itself (a record that verifies with ``key``)."""
    return node in _lease_records(RunDir(run_dir), key, job_id, [node], time.time(), lambda line: None)[0]


def shows_a_lost_node(run_dir: str, job_id: str, nodes: int, key: "JobKey | None", now: float | None = None) -> bool:
    """Whether a node of job ``job_id`` fenced itself or stopped beating, by records that verify with
    ``key`` (no probe)."""
    now = time.time() if now is None else now
    fenced, ages = _lease_records(RunDir(run_dir), key, job_id, range(nodes), now, lambda line: None)
    return bool(fenced) or any(age >= stale_after() for age in ages.values())
