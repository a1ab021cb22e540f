"""Runs on each SSH host in deferrable mode: the node's torchrun agent, detached from ssh.

A deferred task lets its worker go, so no ssh session may stay open for the job's
lifetime (the blocking SSH backend's lifeline would stop the job). Instead:

``python -m dtrain.launch.backends.ssh.detached_node start --run-dir RD --node N --job-id J [--workdir W] [--grace S] [--lease S [--peer ADDR:PORT]] -- AGENT...``
    reads one JSON line on stdin, ``{"env": {...}, "secret": "<64 hex>"}``: the job's
    environment and its secret, never in an argv. It starts the daemon (this module's
    ``daemon`` verb, in a session of its own, exec'd with DTRAIN_JOB_ID, DTRAIN_NODE_INDEX and
    DTRAIN_RUN_DIR in its environment, so that a stop can check a PID is this job's node before
    signalling it), hands it that line through a pipe, and returns once the daemon's signed
    state record is there. The daemon runs AGENT (with the job's environment, never the
    secret) with its output in ``RD/detached/nodeN.log``; while it runs it touches
    ``RD/detached/nodeN.beat`` every 5 seconds; when it ends, it stops anything the agent left
    and writes ``RD/detached/nodeN.exit.json``. With ``--lease S`` the node **fences itself**
    (stops its tree, records ``fenced`` and exit 255, the lost-node status) when it could not
    reach ``--peer`` (another node's login port: a TCP handshake, nothing sent) for S seconds,
    or when S seconds passed unseen by it (its host was frozen or suspended): a node cut off
    from its job must not train on, holding its GPUs, until someone logs in; nobody could stop
    it from outside. Exit record and heartbeat are on the shared
    filesystem, so whoever watches the job reads them there (:func:`status_from_files`) and
    asks the host over ssh only when the heartbeat is stale. SIGTERM stops the whole tree
    (SIGTERM, ``--grace`` seconds for the ranks to save a checkpoint and exit -- the spec's
    stop_grace -- then SIGKILL) and is recorded.
``... status --run-dir RD --node N --job-id J [--tail 40]``
    prints one JSON line: ``{"state": "running"|"exited"|"lost"|"unknown", "exit_code", "tail",
    "ignored"}``. ``lost``: the daemon is gone without an exit record (the host rebooted, SIGKILL).
``... stop --run-dir RD --node N --job-id J [--grace 5]``
    SIGTERM to the daemon, SIGKILL to whatever of the tree is left after the grace period
    (returns as soon as the daemon has ended; a grace shorter than the daemon's own cuts it
    short), then every process of the job's node left on the host (by its environment).

The run directory is untrusted (the ranks write there): every file is read and written through
:class:`~dtrain.rundir.RunDir` (no symlink followed, bounded reads, exclusive temp files), and the
daemon's state and exit records are signed with the job's secret (:mod:`dtrain.launch.node.records`). ``status``
and ``stop`` read the secret from stdin (``{"secret": ...}``) when the caller has it; without
it no exit record is believed. A record that fails is ignored and named in ``ignored`` (and on
stderr). Before a PID from the state record is signalled or taken for the daemon, its start time
must match the record's and its environment must say this job and node
(:func:`dtrain.launch.node.proctree.of_job`); the job id checked is the caller's (``--job-id``),
never one read from the run directory. Stdlib and psutil (a dependency of the package) only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from dtrain import grammar
from dtrain.errors import SpecError
from dtrain.launch.node.lease import (FENCE_GRACE_S, HEARTBEAT_S, LEASE_CHECK_S, LOST_EXIT_CODE,  # a fenced node's exit code
                                      age_of, hold_lease, parse_peer)
from dtrain.launch.node.proctree import environ_of, kill_job, kill_tree, of_job
from dtrain.launch.node.records import FENCE_REASON_LIMIT, JobKey, RecordError, check, parse
from dtrain.rundir import DETACHED, RunDir, UnsafeRunDir

MODULE = "dtrain.launch.backends.ssh.detached_node"
ANNOUNCE = "[dtrain-detached]"
TAIL_LINES = 40
STATES = ("running", "exited", "lost", "unknown")
#: a record is a few hundred bytes: more is not the daemon's
RECORD_LIMIT = 64 * 1024
#: the stdin line (the job's environment): what one exec could carry, and some
MAX_INPUT_LINE = 16 * 1024 * 1024
#: a PID's start time as psutil reads it twice may differ by rounding: not by a second
START_TIME_SLACK_S = 1.0


def node_dir(run_dir: str) -> str:
    return os.path.join(run_dir, DETACHED)


def names(node: int) -> dict[str, str]:
    """The node's file names in the run directory's ``detached`` folder."""
    base = f"node{node}"
    return {"state": base + ".state.json", "exit": base + ".exit.json", "log": base + ".log", "beat": base + ".beat"}


def paths(run_dir: str, node: int) -> dict[str, str]:
    """The node's files as paths, for messages and tests (the product opens them through RunDir only)."""
    return {kind: os.path.join(node_dir(run_dir), name) for kind, name in names(node).items()}


def log_tail(run_dir: RunDir, node: int, lines: int) -> list[str]:
    try:
        return run_dir.tail(DETACHED, names(node)["log"], lines=lines)
    except UnsafeRunDir:  # the run directory itself was swapped for a link: nothing of it is read
        return []


def read_record(run_dir: RunDir, node: int, kind: str, key: JobKey | None,
                signed: bool = True) -> tuple[dict[str, Any] | None, str | None]:
    """The node's ``kind`` record if it is one: ``(record, None)``; ``(None, None)`` when there is
    none, or when it must be signed and the caller has no key (a stop from a resumed task: it
    judges no outcome); ``(None, why)`` when what is there was ignored. ``signed=False`` checks a
    record's fields without a key: for a state record, whose PID is then checked by environment."""
    name = names(node)[kind]
    if key is None and signed:
        return None, None
    try:
        raw = run_dir.read(DETACHED, name, limit=RECORD_LIMIT)
        if raw is None:
            if run_dir.stat(DETACHED, name) is None:
                return None, None
            raise RecordError(f"not a regular file of at most {RECORD_LIMIT} bytes")
        value = parse(raw)
        if key is not None:
            return key.verify(kind, node, value), None
        if not isinstance(value, dict):
            raise RecordError("not a JSON object")
        return check(kind, value), None
    except (RecordError, UnsafeRunDir) as e:
        return None, f"node {node}: ignored {DETACHED}/{name}: {e}"


def _daemon_process(run_dir: RunDir, node: int, job_id: str, key: JobKey | None):
    """The daemon as a psutil.Process if the state record names a live process that is it (same
    start time, and an environment of this job's node), else None; and what was ignored or refused."""
    import psutil

    state, note = read_record(run_dir, node, "state", key, signed=False)
    if state is None:
        return None, [note] if note else []
    try:
        proc = psutil.Process(state["pid"])
        if (abs(proc.create_time() - state["create_time"]) > START_TIME_SLACK_S
                or proc.status() == psutil.STATUS_ZOMBIE):
            return None, []  # the daemon is gone (its PID may be another process's now)
    except psutil.NoSuchProcess:
        return None, []
    if not of_job(environ_of(proc.pid), job_id, node):
        return None, [f"node {node}: refused PID {proc.pid} named by {DETACHED}/{names(node)['state']}: "
                      f"its environment is not job {job_id}'s node {node}"]
    return proc, []


def _heartbeat(run_dir: RunDir, node: int, interval: float) -> None:
    """Touch the node's beat file every ``interval`` seconds, for as long as the daemon lives (a daemon thread)."""
    while True:
        time.sleep(interval)
        try:
            run_dir.touch(DETACHED, names(node)["beat"])
        except (OSError, UnsafeRunDir):
            pass  # the filesystem hiccuped, or a rank moved things: a stale beat only makes the watcher ask over ssh


# -- start -----------------------------------------------------------------------------------

def _daemon(args: argparse.Namespace, env: dict[str, str], key: JobKey) -> None:
    """The daemon: run the agent, record how it ended. Never returns."""
    import psutil

    run_dir, files = RunDir(args.run_dir), names(args.node)
    code = 1
    stopped: list[int] = []
    fenced: list[str] = []
    ended = threading.Event()
    try:
        log_fd = run_dir.open_append(DETACHED, files["log"], mode=0o600)
        # stdin stays the pipe from start, read to its end (EOF): nothing of ssh's session is held open
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        me = psutil.Process()
        run_dir.touch(DETACHED, files["beat"])  # before the state record: a started node always has a fresh beat
        threading.Thread(target=_heartbeat, args=(run_dir, args.node, HEARTBEAT_S), daemon=True).start()
        run_dir.write_json(DETACHED, files["state"], value=key.sign(
            "state", args.node, {"pid": me.pid, "create_time": me.create_time(), "host": socket.gethostname()[:255]}))
        environ = dict(os.environ)
        environ.update(env)

        def on_signal(signum, _frame):
            stopped.append(signum)
            threading.Thread(target=kill_tree, args=(me, args.grace, args.job_id, args.node), daemon=True).start()

        def fence(reason: str) -> None:
            fenced.append(reason)
            print(f"{ANNOUNCE} node={args.node}: {reason}; fencing: stopping its ranks", flush=True)
            kill_tree(me, min(args.grace, FENCE_GRACE_S), args.job_id, args.node)

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, on_signal)
        child = subprocess.Popen(args.agent, env=environ, cwd=args.workdir or None, stdin=subprocess.DEVNULL)
        if stopped:  # a stop raced the start: the agent must not outlive it
            kill_tree(me, args.grace, args.job_id, args.node)
        if args.lease:
            threading.Thread(target=hold_lease, args=(args.lease, args.peer_address, ended, fence), daemon=True).start()
        raw = child.wait()
        ended.set()
        code = LOST_EXIT_CODE if fenced else 128 - raw if raw < 0 else raw
        kill_tree(me, args.grace, args.job_id, args.node)  # anything the agent left behind goes too, in or out of the tree
    except BaseException as e:  # the record must be written whatever happened
        print(f"{ANNOUNCE} node={args.node}: {e!r}", flush=True)
    finally:
        try:
            run_dir.write_json(DETACHED, files["exit"], value=key.sign(
                "exit", args.node, {"exit_code": code, "stopped_by_signal": stopped[0] if stopped else None,
                                    "time": time.time(), "fenced": fenced[0][:FENCE_REASON_LIMIT] if fenced else None}))
        except (OSError, ValueError) as e:  # a rank replaced the folder: the watcher will find the node lost
            print(f"{ANNOUNCE} node={args.node}: could not write the exit record: {e!r}", flush=True)
        sys.stdout.flush()
        os._exit(0)


def daemon_argv(args: argparse.Namespace) -> list[str]:
    options = ["--run-dir", args.run_dir, "--node", str(args.node), "--job-id", args.job_id, "--grace", f"{args.grace:g}"]
    if args.workdir:
        options += ["--workdir", args.workdir]
    if args.lease:
        options += ["--lease", f"{args.lease:g}"]
    if args.peer:
        options += ["--peer", args.peer]  # as given (checked): rebuilt from the tuple, an IPv6 address lost its brackets
    return [sys.executable, "-m", MODULE, "daemon", *options, "--", *args.agent]


def daemon_env(args: argparse.Namespace) -> dict[str, str]:
    """The daemon's own environment: the job's node first (a bounded reader of /proc/PID/environ
    finds them), then this process's."""
    ours = {"DTRAIN_JOB_ID": args.job_id, "DTRAIN_NODE_INDEX": str(args.node), "DTRAIN_RUN_DIR": args.run_dir}
    return {**ours, **{k: v for k, v in os.environ.items() if k not in ours}}


def start(args: argparse.Namespace, line: bytes, key: JobKey) -> int:
    run_dir, files = RunDir(args.run_dir), names(args.node)
    run_dir.ensure_dir(DETACHED)  # a planted link or file there is removed, never followed
    for kind in ("state", "exit", "beat"):  # a relaunch in the same run directory starts clean
        run_dir.remove(DETACHED, files[kind])
    daemon = subprocess.Popen(daemon_argv(args), env=daemon_env(args), stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        daemon.stdin.write(line)
        daemon.stdin.close()
    except BrokenPipeError:
        pass  # it died at once: reported below
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state, _ = read_record(run_dir, args.node, "state", key)
        if state is not None and state["pid"] == daemon.pid:
            print(f"{ANNOUNCE} node={args.node} pid={state['pid']} host={state['host']}", flush=True)
            return 0
        if daemon.poll() is not None:
            break
        time.sleep(0.05)
    print(f"{ANNOUNCE} node={args.node}: the daemon did not start; see {paths(args.run_dir, args.node)['log']}",
          file=sys.stderr)
    return 1


# -- status / stop ---------------------------------------------------------------------------

def _exited(run_dir: RunDir, node: int, record: dict, tail: int, ignored: list[str]) -> dict:
    """An exited node's status. A node that was stopped (SIGTERM from ``stop``, or its host shutting
    down) never reads as a success, even when its agent then exited 0 (ranks that save a checkpoint
    and exit cleanly on SIGTERM): its code is 128 + the signal, as the retry policy reads a preemption."""
    signum = record["stopped_by_signal"]
    code = record["exit_code"] or (128 + signum if signum else 0)
    return {"node": node, "state": "exited", "exit_code": code, "stopped_by_signal": record["stopped_by_signal"],
            "fenced": record.get("fenced"), "tail": log_tail(run_dir, node, tail) if code else [], "ignored": ignored}


def status_from_files(run_dir: str, node: int, now: float, stale_after: float, tail: int = TAIL_LINES, *,
                      key: JobKey | None = None) -> dict | None:
    """The node's status from the shared filesystem alone, or None when only its host can tell.

    Exited: its exit record, signed with ``key`` (without a key no exit record is believed).
    Running: a heartbeat younger than ``stale_after`` seconds (by this host's clock against the
    file's mtime: clocks synchronised to well within ``stale_after``, as NTP/chrony keep them; a
    skewed clock costs an ssh call, never a wrong verdict, because "lost" is only ever decided by
    the host). None: stale or missing, ask the host. A record ignored is named in ``ignored``.
    """
    files = RunDir(run_dir)
    record, note = read_record(files, node, "exit", key)
    ignored = [note] if note else []
    if record is not None:
        return _exited(files, node, record, tail, ignored)
    age = beat_age(run_dir, node, now)
    if age is not None and age < stale_after:
        return {"node": node, "state": "running", "exit_code": None, "tail": [], "ignored": ignored}
    return None  # only the host can tell


def beat_age(run_dir: str, node: int, now: float) -> float | None:
    """Seconds since the node's heartbeat (by ``now`` against the file's mtime); None without one."""
    return age_of(RunDir(run_dir), now, DETACHED, names(node)["beat"])


def status(run_dir: RunDir, node: int, job_id: str, key: JobKey | None, tail: int = TAIL_LINES) -> dict:
    """The node's status as its host sees it (see the module docstring)."""
    try:
        return _status(run_dir, node, job_id, key, tail)
    except UnsafeRunDir as e:  # a rank swapped the run directory for a link: nothing in it is believed
        return {"node": node, "state": "lost", "exit_code": None, "tail": [], "ignored": [f"node {node}: {e}"]}


def _status(run_dir: RunDir, node: int, job_id: str, key: JobKey | None, tail: int) -> dict:
    record, note = read_record(run_dir, node, "exit", key)
    ignored = [note] if note else []
    if record is not None:
        return _exited(run_dir, node, record, tail, ignored)
    daemon, refused = _daemon_process(run_dir, node, job_id, key)
    ignored += refused
    if daemon is not None:
        return {"node": node, "state": "running", "exit_code": None, "tail": [], "ignored": ignored}
    # Re-read: the daemon may have written its record between the two reads.
    record, _ = read_record(run_dir, node, "exit", key)
    if record is not None:
        return _exited(run_dir, node, record, tail, ignored)
    if run_dir.stat(DETACHED, names(node)["state"]) is None:
        return {"node": node, "state": "unknown", "exit_code": None, "tail": [], "ignored": ignored}
    return {"node": node, "state": "lost", "exit_code": None, "tail": log_tail(run_dir, node, tail), "ignored": ignored}


def stop(run_dir: RunDir, node: int, job_id: str, key: JobKey | None, grace: float = 5.0) -> dict:
    import psutil

    daemon, ignored = _daemon_process(run_dir, node, job_id, key)
    if daemon is not None:
        try:
            descendants = daemon.children(recursive=True)
            daemon.send_signal(signal.SIGTERM)
            gone, alive = psutil.wait_procs([daemon], timeout=grace + 5)
            if alive:
                kill_tree(daemon, 1.0)
                daemon.kill()
            survivors = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            for proc in survivors:
                proc.kill()
        except psutil.NoSuchProcess:
            pass
    # A lost daemon (or one whose state record was not believed) leaves no tree to walk: the job's
    # node's processes, by environment, get the grace period the daemon would have given them.
    kill_job(job_id, grace, node)
    result = status(run_dir, node, job_id, key, 0)
    result["ignored"] = ignored + [note for note in result["ignored"] if note not in ignored]
    return result


# -- command line ----------------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    # The agent's argv follows "--" and is split off first: it may contain anything.
    options, agent = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="detached_node")
    p.add_argument("verb", choices=("start", "daemon", "status", "stop"))
    p.add_argument("--run-dir", required=True)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--job-id", required=True)
    p.add_argument("--workdir")
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--tail", type=int, default=TAIL_LINES)
    p.add_argument("--lease", type=float, default=0.0,
                   help="fence the node after this many seconds cut off from --peer, or frozen (0: never)")
    p.add_argument("--peer", help="ADDRESS:PORT of another node's login port, reached every few seconds")
    args = p.parse_args(options)
    args.agent = agent
    try:
        RunDir(args.run_dir)
    except UnsafeRunDir:
        p.error(f"--run-dir={args.run_dir!r} is invalid: an absolute, normalized path")
    try:
        grammar.check("--job-id", args.job_id, grammar.NAME, "letters, digits and _ . + - (1-128)")
        grammar.finite("--node", args.node, minimum=0, maximum=1 << 20)
        grammar.finite("--grace", args.grace, minimum=0, maximum=3600)
        grammar.finite("--tail", args.tail, minimum=0, maximum=10000)
        if args.lease:
            grammar.finite("--lease", args.lease, minimum=LEASE_CHECK_S * 2, maximum=86400)
        args.peer_address = None if args.peer is None else parse_peer(args.peer)
    except SpecError as e:
        p.error(str(e))
    if args.verb in ("start", "daemon") and not args.agent:
        p.error("start needs the agent command after --")
    return args


def read_input(args: argparse.Namespace) -> tuple[bytes, dict[str, str], JobKey | None]:
    """The stdin line (bounded), the environment and the job's key in it; SpecError naming the field."""
    if args.verb in ("status", "stop") and sys.stdin.isatty():
        return b"", {}, None
    line = sys.stdin.buffer.readline(MAX_INPUT_LINE + 1)
    if len(line) > MAX_INPUT_LINE:
        raise SpecError("stdin", f"<a line over {MAX_INPUT_LINE} bytes>", "one JSON line of at most 16 MiB")
    value = parse(line) if line.strip() else {}
    if not isinstance(value, dict):
        raise SpecError("stdin", type(value).__name__, 'a JSON object: {"env": {...}, "secret": "<64 hex>"}')
    env = value.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) and "\0" not in k + v
                                            for k, v in env.items()):
        raise SpecError("env", "<not shown>", "a mapping of variable names to text without NUL")
    secret = value.get("secret")
    if secret is None and args.verb in ("start", "daemon"):
        raise SpecError("secret", None, "the job's secret (64 lowercase hex digits) on stdin")
    return line, env, None if secret is None else JobKey(args.job_id, secret)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        line, env, key = read_input(args)
    except (SpecError, RecordError) as e:
        print(f"{ANNOUNCE} node={args.node}: {e}", file=sys.stderr)
        return 2
    if args.verb == "start":
        try:
            return start(args, line, key)
        except UnsafeRunDir as e:
            print(f"{ANNOUNCE} node={args.node}: {e}", file=sys.stderr)
            return 1
    if args.verb == "daemon":
        _daemon(args, env, key)
    run_dir = RunDir(args.run_dir)
    if args.verb == "status":
        result = status(run_dir, args.node, args.job_id, key, args.tail)
    else:
        result = stop(run_dir, args.node, args.job_id, key, args.grace)
    for note in result["ignored"]:
        print(f"{ANNOUNCE} {note}", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
