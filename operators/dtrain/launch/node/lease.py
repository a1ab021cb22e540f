"""A node's lease on its job: it fences itself when it is cut off, and beats so that a watcher can tell.

Nobody can stop a node's ranks from outside once the node is cut off from its job (a partition) or
was frozen while its job was given up: they would train on, holding their GPUs, until someone logs
in. So every node holds a lease: it checks every LEASE_CHECK_S seconds that it still reaches its
**peer** (a TCP handshake, nothing sent) and **fences itself** (stops every process of the job's
node on its host, with FENCE_GRACE_S) once it has not reached it for the lease, or as soon as the
lease passed between two checks unseen by it (its host was frozen or suspended: whatever happened
meanwhile, the watcher has given the node up).

* ssh, deferred/durable: the detached node's daemon (:mod:`dtrain.launch.backends.ssh.detached_node`)
  holds it with :func:`hold_lease`, its peer another node's login port.
* mpi (mpirun over ssh): the rank wrapper of each node's local rank 0 holds it in a thread
  (:func:`start_from_env`), its peer the next node's login port, from the variables the launcher
  exported (:func:`lease_env`); it beats like Slurm's nodes, below, and the launcher probes the nodes'
  login ports on a sign (:func:`dtrain.launch.core.lost.lost_by_leases`).
* Slurm: each node shell starts it beside the node's agent
  (:mod:`dtrain.launch.backends.slurm.node_lease`), its peer the next node's slurmd and its own
  slurmd checked too: Slurm notices a silent node only after its SlurmdTimeout (minutes), and then
  cannot reach it to stop its ranks either. It also writes ``lease/<job id>/node<N>.beat`` in the
  run directory every HEARTBEAT_S seconds (a frozen or crashed node stops beating: the launcher then
  asks the node's host, :mod:`dtrain.launch.backends.slurm.lost`) and records a fence in
  ``lease/<job id>/node<N>.fenced`` (read as untrusted: any rank can write there). A folder per
  job: a retry runs in the same run directory (it resumes from the checkpoints there), and the job
  it replaces left its nodes' beats and fences behind; its nodes may even beat or fence after the
  retry started (a partitioned node whose link heals, a frozen one that thaws).

**The records decide nothing unless the holder signed them.** Any rank can write the lease folder,
so with a key (:func:`read_key`: Slurm's node shell hands it over on the holder's stdin, never in an
environment, an argv or the run directory) each beat and fence is a record signed like the detached
SSH daemon's (:class:`dtrain.launch.node.records.JobKey`: HMAC-SHA256 over canonical JSON that
names its kind, job and node), and a record that does not verify is refused (:class:`RecordError`),
never read as the holder's. A beat's age is its file's status-change time (ctime), which the kernel
sets to now on every change: ``os.utime`` back-dates the mtime a watcher would otherwise read, not the
ctime. Without a key (mpi: the holder is a thread of a rank) the records are unsigned hints, and the
launcher takes no verdict from a fence record that its own probe contradicts
(:func:`dtrain.launch.core.lost.lost_by_leases`).

Stdlib and psutil only (it runs on every node, before and beside the ranks).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, MutableMapping, Sequence

from dtrain import grammar
from dtrain.errors import SpecError
from dtrain.launch.node.job_secret import mac, read_stdin_line
from dtrain.launch.node.proctree import kill_job
from dtrain.launch.node.records import FENCE_REASON_LIMIT, JobKey, RecordError, check, parse
from dtrain.rundir import LEASE, RunDir, UnsafeRunDir

#: the exit status of a launch that lost a node (dtrain.launch.engine.retry: a lost node, retried), and
#: of a node that fenced itself (ssh's own code for a lost connection)
LOST_EXIT_CODE = 255
#: seconds a node that fences itself gives its ranks between SIGTERM and SIGKILL (not the stop
#: grace): cut off from its peers, they cannot reach a checkpoint, and every second they live is a
#: second they may hold GPUs the retry needs
FENCE_GRACE_S = 2.0
#: how often a node with a lease checks it (a handshake with its peer, and the clock)
LEASE_CHECK_S = 5.0
#: how often a node writes its beat record
HEARTBEAT_S = 5.0
#: a heartbeat older than this many intervals is stale: only then is the node's host asked
STALE_BEATS = 3
#: the most a beat or fence record can be (read bounded: a larger file is nobody's record)
RECORD_LIMIT = FENCE_REASON_LIMIT + 512
ANNOUNCE = "[dtrain-lease]"
#: the kinds of lease record (:data:`dtrain.launch.node.records.FIELDS` says what each holds)
BEAT, FENCE = "beat", "fence"
PR_SET_DUMPABLE = 4


def reaches(peer: tuple[str, int], timeout: float) -> bool:
    """Whether a TCP handshake with ``peer`` completes within ``timeout`` (nothing is sent)."""
    try:
        socket.create_connection(peer, timeout=timeout).close()
        return True
    except OSError:
        return False


def boot_clock() -> float:
    """Seconds on a clock that also runs while the host is suspended (a frozen cgroup: any clock)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def hold_lease(lease: float, peer: tuple[str, int] | None, ended: threading.Event, fence: Callable[[str], Any],
               check_every: float = LEASE_CHECK_S, clock: Callable[[], float] = boot_clock,
               own: tuple[str, int] | None = None) -> None:
    """Call ``fence(reason)`` once the node has not reached ``peer`` for ``lease`` seconds, or its ``own``
    daemon (the node's slurmd: without it nobody can stop this node's ranks) for that long, or as soon
    as ``lease`` seconds passed between two checks (the host was frozen: whatever happened meanwhile,
    the launcher has given the node up); return without fencing once ``ended`` is set."""
    last_check = last_reached = last_own = clock()
    while not ended.wait(check_every):
        now = clock()
        if now - last_check >= lease:
            return fence(f"this node was stopped for {now - last_check:.0f} s (frozen or suspended): "
                         f"its lease of {lease:g} s lapsed meanwhile")
        if peer is None or reaches(peer, min(check_every, lease / 3)):
            last_reached = clock()
        elif (cut_off := clock() - last_reached) >= lease:
            return fence(f"this node could not reach its peer {peer[0]}:{peer[1]} for {cut_off:.0f} s "
                         f"(its lease of {lease:g} s lapsed): it is cut off from its job")
        if own is not None and reaches(own, min(check_every, lease / 3)):
            last_own = clock()
        elif own is not None and (alone := clock() - last_own) >= lease:
            return fence(f"this node's own daemon at {own[0]}:{own[1]} has not answered for {alone:.0f} s (its "
                         f"lease of {lease:g} s lapsed): nothing could stop this node's ranks any more")
        last_check = clock()


def beat_name(node: int) -> str:
    return f"node{node}.beat"


def fenced_name(node: int) -> str:
    return f"node{node}.fenced"


#: the node secrets' field that holds the lease key (:func:`read_key`)
KEY_FIELD = "lease_key"


def lease_key(secret: str) -> str:
    """The lease key of a job whose secret is ``secret`` (64 hex digits each): its own, so that whoever
    learns it on a node learns nothing else the job's secret signs."""
    return mac(bytes.fromhex(secret), b"dtrain node lease")


def read_key(fd: int, job_id: str) -> JobKey | None:
    """The lease key the node shell wrote on the holder's ``fd`` (its stdin: one JSON line,
    ``{"lease_key": "<64 hex>", ...}``), which then points at /dev/null; None when it wrote none (the
    lease then holds and fences, its records unsigned); SpecError for a line that is not that. This
    process is made non-dumpable first: another process of the ranks' user cannot read its memory (root can)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    line = read_stdin_line(fd).strip()
    if not line:
        return None
    try:
        return JobKey(job_id, json.loads(line)[KEY_FIELD])
    except (ValueError, TypeError, KeyError, SpecError):
        raise SpecError("stdin", "<not shown>", '{"lease_key": "<64 lowercase hex digits>"} on one line') from None


def record(key: JobKey | None, kind: str, node: int, fields: dict[str, Any]) -> bytes:
    """A lease record's bytes: signed with ``key``, plain without one."""
    return json.dumps(key.sign(kind, node, fields) if key is not None else fields).encode()


def beat(run_dir: RunDir, job_id: str, node: int, interval: float, ended: threading.Event,
         key: JobKey | None = None) -> None:
    """Write the node's beat record now and every ``interval`` seconds until ``ended`` is set."""
    while True:
        try:
            run_dir.ensure_dir(LEASE, job_id)  # the lease folder is the product's: a link or file planted there goes
            run_dir.write(LEASE, job_id, beat_name(node), data=record(key, BEAT, node, {"time": time.time()}))
        except (OSError, UnsafeRunDir):
            pass  # the filesystem hiccuped, or a rank moved things: a stale beat only makes the watcher look
        if ended.wait(interval):
            return


def age_of(run_dir: RunDir, now: float, *parts: str) -> float | None:
    """Seconds since the regular file at ``parts`` last changed (by ``now`` against its ctime, so clocks
    synchronised to well within a beat, as NTP/chrony keep them); None without one. The ctime, not the
    mtime: any process of the job can back-date the mtime (``os.utime``); the kernel sets the ctime to
    now on every change, that one included."""
    try:
        found = run_dir.stat(*parts)
    except UnsafeRunDir:
        return None
    return now - found.st_ctime if found is not None and stat.S_ISREG(found.st_mode) else None


def read_record(run_dir: RunDir, key: JobKey | None, job_id: str, node: int, kind: str) -> dict[str, Any] | None:
    """Node ``node``'s ``kind`` record of job ``job_id``, checked field by field: verified with ``key``
    (unsigned records are read as they are only without one); None when there is none; RecordError
    naming why when a record is there that its holder did not write."""
    try:
        raw = run_dir.read(LEASE, job_id, (beat_name if kind == BEAT else fenced_name)(node), limit=RECORD_LIMIT)
    except (OSError, UnsafeRunDir):
        return None
    if raw is None:  # none, or larger than any record: not the holder's
        return None
    value = parse(raw)
    if key is not None:
        return key.verify(kind, node, value)
    if not isinstance(value, dict):
        raise RecordError(f"not a {kind} record")
    return check(kind, value)


def beat_age(run_dir: RunDir, job_id: str, node: int, now: float, key: JobKey | None = None) -> float | None:
    """Seconds since node ``node`` of job ``job_id`` last beat (None: it never did); RecordError for a beat
    record its holder did not sign (``key``)."""
    if read_record(run_dir, key, job_id, node, BEAT) is None:
        return None
    return age_of(run_dir, now, LEASE, job_id, beat_name(node))


def read_fence(run_dir: RunDir, job_id: str, node: int, key: JobKey | None = None) -> str | None:
    """The reason node ``node`` of job ``job_id`` recorded for fencing itself, if it did (text for a log
    line, bounded); RecordError for a fence record its holder did not sign (``key``)."""
    found = read_record(run_dir, key, job_id, node, FENCE)
    if found is None:
        return None
    return "".join(c if c.isprintable() else "?" for c in found["reason"][:FENCE_REASON_LIMIT])


def parse_peer(text: str, field: str = "--peer") -> tuple[str, int]:
    """``ADDRESS:PORT`` (a host as a hostfile names it, a port 1-65535) as a tuple; SpecError otherwise."""
    match = grammar.HOST_TARGET.match(text)
    if match is None or match["user"] or not match["port"] or not 0 < int(match["port"]) < 65536:
        raise SpecError(field, text, "ADDRESS:PORT: a host name, IPv4 or [IPv6] address, and a port 1-65535")
    return match["host"].strip("[]"), int(match["port"])


def run(run_dir: str, node: int, job_id: str, lease: float, peer: tuple[str, int] | None,
        check_every: float = LEASE_CHECK_S, heartbeat: float = HEARTBEAT_S, own: tuple[str, int] | None = None,
        key: JobKey | None = None) -> int:
    """Beat and hold the lease until the node is fenced (then 0; the caller ends the holder otherwise);
    ``key`` signs the records."""
    files = RunDir(run_dir)
    ended = threading.Event()
    threading.Thread(target=beat, args=(files, job_id, node, heartbeat, ended, key), daemon=True).start()

    def fence(reason: str) -> None:
        ended.set()  # a fenced node beats no more
        print(f"{ANNOUNCE} node={node}: {reason}; fencing: stopping its ranks", file=sys.stderr, flush=True)
        try:
            files.ensure_dir(LEASE, job_id)
            files.write(LEASE, job_id, fenced_name(node),
                        data=record(key, FENCE, node, {"time": time.time(), "reason": reason[:FENCE_REASON_LIMIT]}))
        except (OSError, ValueError, UnsafeRunDir):
            pass  # the fence matters, not its record
        kill_job(job_id, FENCE_GRACE_S, node)

    hold_lease(lease, peer, threading.Event(), fence, check_every=check_every, own=own)
    return 0


#: the variables with which a launcher asks each node's rank wrapper to hold the node's lease (mpi):
#: the lease in seconds, and every node's login ``ADDRESS:PORT`` in node order (its peer is the next)
LEASE_ENV, PEERS_ENV = "DTRAIN_LEASE_SECONDS", "DTRAIN_LEASE_PEERS"


def lease_env(endpoints: Sequence[tuple[str, int]], lease: float) -> dict[str, str]:
    """The variables that ask every node to hold a lease of ``lease`` seconds on the job."""
    return {LEASE_ENV: f"{lease:g}",
            PEERS_ENV: ",".join(f"[{a}]:{p}" if ":" in a else f"{a}:{p}" for a, p in endpoints)}


def lease_of_env(environ: MutableMapping[str, str]) -> tuple[int, float, tuple[str, int] | None] | None:
    """(node, lease, peer) of this node, the lease's variables taken out of ``environ`` (the rank must not
    inherit them); None when the launcher asked for no lease. The node is ``DTRAIN_NODE_INDEX``; its
    peer the next node's endpoint (none for a single node). SpecError naming the variable on a bad value."""
    seconds, peers = environ.pop(LEASE_ENV, None), environ.pop(PEERS_ENV, "")
    if seconds is None:
        return None
    lease = grammar.finite(LEASE_ENV, seconds, minimum=LEASE_CHECK_S * 2, maximum=86400)
    endpoints = [parse_peer(text, PEERS_ENV) for text in peers.split(",")] if peers else []
    node = environ.get("DTRAIN_NODE_INDEX", "")
    if not (node.isascii() and node.isdigit() and int(node) < max(1, len(endpoints))):
        raise SpecError("DTRAIN_NODE_INDEX", node, f"a node index below {max(1, len(endpoints))} ({PEERS_ENV})")
    index = int(node)
    return index, lease, endpoints[(index + 1) % len(endpoints)] if len(endpoints) > 1 else None


def start_from_env(environ: MutableMapping[str, str]) -> bool:
    """Hold this node's lease in a daemon thread of this process when the launcher asked for one and
    this is the node's local rank 0 (one holder per node); whether it does. The variables are taken
    out of ``environ`` on every rank. A bad value is reported and holds no lease (the job runs on,
    as without one)."""
    try:
        asked = lease_of_env(environ)
        if asked is None or environ.get("LOCAL_RANK") != "0":
            return False
        job_id = grammar.check("DTRAIN_JOB_ID", environ.get("DTRAIN_JOB_ID", ""), grammar.NAME,
                               "letters, digits and _ . + - (1-128)")
        run_dir = environ.get("DTRAIN_RUN_DIR", "")
        RunDir(run_dir)
    except (SpecError, UnsafeRunDir) as e:
        print(f"{ANNOUNCE} no lease held: {e}", file=sys.stderr, flush=True)
        return False
    node, seconds, peer = asked
    threading.Thread(target=run, args=(run_dir, node, job_id, seconds, peer), name="dtrain-lease", daemon=True).start()
    return True


@dataclass(frozen=True)
class LeaseArgs:
    run_dir: str
    node: int
    job_id: str
    lease: float
    peer: tuple[str, int] | None
    own: tuple[str, int] | None


def parse_args(argv: list[str] | None, prog: str = "python -m dtrain.launch.node.lease",
               targets: Sequence[str] = ("peer", "own")) -> LeaseArgs:
    """The lease's arguments, checked (exit 2 naming the field, the value and what is allowed, before
    anything starts). ``targets``: which of --peer and --own are taken (a backend may find them itself)."""
    parser = argparse.ArgumentParser(prog=prog, description="hold this node's lease on its job")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--lease", required=True, help="seconds without reaching the peer before fencing")
    if "peer" in targets:
        parser.add_argument("--peer", default="", help="ADDRESS:PORT this node must reach (empty: only the clock check)")
    if "own" in targets:
        parser.add_argument("--own", default="", help="ADDRESS:PORT of this node's own daemon, which must answer")
    args = parser.parse_args(argv)
    try:
        grammar.check("--job-id", args.job_id, grammar.NAME, "letters, digits and _ . + - (1-128)")
        node = int(grammar.finite("--node", args.node, minimum=0, maximum=1 << 20))
        lease = grammar.finite("--lease", args.lease, minimum=LEASE_CHECK_S * 2, maximum=86400)
        peer = parse_peer(args.peer) if "peer" in targets and args.peer else None
        own = parse_peer(args.own, "--own") if "own" in targets and args.own else None
        RunDir(args.run_dir)
    except (SpecError, UnsafeRunDir) as e:
        parser.error(str(e))
    return LeaseArgs(args.run_dir, node, args.job_id, lease, peer, own)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run(args.run_dir, args.node, args.job_id, args.lease, args.peer, own=args.own)


if __name__ == "__main__":
    sys.exit(main())
