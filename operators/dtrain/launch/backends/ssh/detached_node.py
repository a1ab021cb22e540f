"""Runs on each SSH host in deferrable mode: the node's torchrun agent, detached from ssh.

A deferred task lets its worker go, so no ssh session may stay open for the job's
lifetime (the blocking SSH backend's lifeline would stop the job). Instead:

``python -m dtrain.launch.backends.ssh.detached_node start --run-dir RD --node N --job-id J [--workdir W] [--grace S] -- AGENT...``
    reads the job's environment as one JSON line on stdin (never in an argv), double-forks
    a daemon in its own session, and returns once the daemon has written its state file.
    The daemon runs AGENT with its output in ``RD/detached/nodeN.log``; while it runs it
    touches ``RD/detached/nodeN.beat`` every 5 seconds; when it
    ends, it stops anything the agent left and writes ``RD/detached/nodeN.exit.json`` (temp
    file + rename). Exit record and heartbeat are on the shared filesystem, so whoever watches
    the job reads them there (:func:`status_from_files`) and asks the host over ssh only when
    the heartbeat is stale. SIGTERM stops the whole tree (SIGTERM, ``--grace`` seconds for the ranks to
    save a checkpoint and exit -- the spec's stop_grace -- then SIGKILL) and is recorded.
``... status --run-dir RD --node N [--tail 40]``
    prints one JSON line: ``{"state": "running"|"exited"|"lost"|"unknown", "exit_code", "tail"}``.
    ``lost``: the daemon is gone without an exit record (the host rebooted, SIGKILL).
``... stop --run-dir RD --node N [--grace 5]``
    SIGTERM to the daemon, SIGKILL to whatever of the tree is left after the grace period
    (returns as soon as the daemon has ended; a grace shorter than the daemon's own cuts it short).

The PID in the state file is checked with its start time, so a reused PID is never
mistaken for the daemon. Stdlib and psutil (a dependency of the package) only.
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

from dtrain.launch.proctree import kill_job, kill_tree

ANNOUNCE = "[dtrain-detached]"
TAIL_LINES = 40
HEARTBEAT_S = 5.0
#: a heartbeat older than this many intervals is stale: only then is the host asked over ssh
STALE_BEATS = 3


def node_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "detached")


def paths(run_dir: str, node: int) -> dict[str, str]:
    base = os.path.join(node_dir(run_dir), f"node{node}")
    return {"state": base + ".state.json", "exit": base + ".exit.json", "log": base + ".log", "beat": base + ".beat"}


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _tail(path: str, lines: int) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 256 * 1024))
            return fh.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _daemon_process(state: dict | None):
    """The daemon as a psutil.Process if it still runs (same PID *and* start time), else None."""
    import psutil

    if not state:
        return None
    try:
        proc = psutil.Process(int(state["pid"]))
        if abs(proc.create_time() - float(state["create_time"])) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (psutil.NoSuchProcess, KeyError, ValueError, TypeError):
        return None


def _beat(path: str) -> None:
    with open(path, "a", encoding="utf-8"):
        pass
    os.utime(path)


def _heartbeat(path: str, interval: float) -> None:
    """Touch ``path`` every ``interval`` seconds, for as long as the daemon lives (a daemon thread)."""
    while True:
        time.sleep(interval)
        try:
            _beat(path)
        except OSError:
            pass  # the filesystem hiccuped: a stale beat only makes the watcher ask over ssh


# -- start -----------------------------------------------------------------------------------

def _daemon(args: argparse.Namespace, env: dict[str, str]) -> None:
    """The grandchild: run the agent, record how it ended. Never returns."""
    import psutil

    files = paths(args.run_dir, args.node)
    code = 1
    stopped: list[int] = []
    try:
        log_fd = os.open(files["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        me = psutil.Process()
        _beat(files["beat"])  # before the state file: a started node always has a fresh beat
        threading.Thread(target=_heartbeat, args=(files["beat"], HEARTBEAT_S), daemon=True).start()
        _write_json(files["state"], {"pid": me.pid, "pgid": os.getpgrp(), "create_time": me.create_time(),
                                     "host": socket.gethostname(), "job_id": args.job_id, "node": args.node})
        environ = dict(os.environ)
        environ.update(env)

        def on_signal(signum, _frame):
            stopped.append(signum)
            threading.Thread(target=kill_tree, args=(me, args.grace, args.job_id, args.node), daemon=True).start()

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, on_signal)
        child = subprocess.Popen(args.agent, env=environ, cwd=args.workdir or None, stdin=subprocess.DEVNULL)
        if stopped:  # a stop raced the start: the agent must not outlive it
            kill_tree(me, args.grace, args.job_id, args.node)
        raw = child.wait()
        code = 128 - raw if raw < 0 else raw
        kill_tree(me, args.grace, args.job_id, args.node)  # anything the agent left behind goes too, in or out of the tree
    except BaseException as e:  # the record must be written whatever happened
        print(f"{ANNOUNCE} node={args.node}: {e!r}", flush=True)
    finally:
        _write_json(files["exit"], {"exit_code": code, "stopped_by_signal": stopped[0] if stopped else None,
                                    "time": time.time()})
        sys.stdout.flush()
        os._exit(0)


def start(args: argparse.Namespace) -> int:
    line = sys.stdin.buffer.readline().decode()
    try:
        env = json.loads(line)["env"] if line.strip() else {}
    except (ValueError, KeyError, TypeError) as e:
        print(f"{ANNOUNCE} node={args.node}: bad environment line on stdin ({e})", file=sys.stderr)
        return 2
    files = paths(args.run_dir, args.node)
    os.makedirs(node_dir(args.run_dir), exist_ok=True)
    for key in ("state", "exit", "beat"):  # a relaunch in the same run directory starts clean
        try:
            os.unlink(files[key])
        except FileNotFoundError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    first = os.fork()
    if first == 0:
        os.setsid()  # a session of its own: no controlling terminal, not killed with ssh's session
        if os.fork() == 0:
            _daemon(args, env)
        os._exit(0)
    os.waitpid(first, 0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = _read_json(files["state"])
        if state:
            print(f"{ANNOUNCE} node={args.node} pid={state['pid']} host={state['host']}", flush=True)
            return 0
        time.sleep(0.05)
    print(f"{ANNOUNCE} node={args.node}: the daemon did not start; see {files['log']}", file=sys.stderr)
    return 1


# -- status / stop ---------------------------------------------------------------------------

def _exited(files: dict[str, str], node: int, record: dict, tail: int) -> dict:
    code = int(record.get("exit_code", 1))
    return {"node": node, "state": "exited", "exit_code": code, "stopped_by_signal": record.get("stopped_by_signal"),
            "tail": _tail(files["log"], tail) if code else []}


def status_from_files(run_dir: str, node: int, now: float, stale_after: float, tail: int = TAIL_LINES) -> dict | None:
    """The node's status from the shared filesystem alone, or None when only its host can tell.

    Exited: its exit record. Running: a heartbeat younger than ``stale_after`` seconds (by this
    host's clock against the file's mtime: clocks synchronised to well within ``stale_after``,
    as NTP/chrony keep them; a skewed clock costs an ssh call, never a wrong verdict, because
    "lost" is only ever decided by the host). None: stale or missing, ask the host.
    """
    files = paths(run_dir, node)
    record = _read_json(files["exit"])
    if record is not None:
        return _exited(files, node, record, tail)
    try:
        age = now - os.stat(files["beat"]).st_mtime
    except OSError:
        return None
    if age < stale_after:
        return {"node": node, "state": "running", "exit_code": None, "tail": []}
    return None


def status(run_dir: str, node: int, tail: int = TAIL_LINES) -> dict:
    files = paths(run_dir, node)
    record = _read_json(files["exit"])
    if record is not None:
        return _exited(files, node, record, tail)
    state = _read_json(files["state"])
    if state is None:
        return {"node": node, "state": "unknown", "exit_code": None, "tail": []}
    if _daemon_process(state) is not None:
        return {"node": node, "state": "running", "exit_code": None, "tail": []}
    # Re-read: the daemon may have written its record between the two reads.
    record = _read_json(files["exit"])
    if record is not None:
        return status(run_dir, node, tail)
    return {"node": node, "state": "lost", "exit_code": None, "tail": _tail(files["log"], tail)}


def stop(run_dir: str, node: int, grace: float = 5.0) -> dict:
    import psutil

    state = _read_json(paths(run_dir, node)["state"])
    daemon = _daemon_process(state)
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
    if state and state.get("job_id"):  # a lost daemon leaves no tree to walk: find the job's processes
        kill_job(str(state["job_id"]), 1.0, node)
    return status(run_dir, node, 0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    # The agent's argv follows "--" and is split off first: it may contain anything.
    options, agent = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="detached_node")
    p.add_argument("verb", choices=("start", "status", "stop"))
    p.add_argument("--run-dir", required=True)
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--job-id", default="")
    p.add_argument("--workdir")
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--tail", type=int, default=TAIL_LINES)
    args = p.parse_args(options)
    args.agent = agent
    if args.verb == "start" and not args.agent:
        p.error("start needs the agent command after --")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.verb == "start":
        return start(args)
    result = status(args.run_dir, args.node, args.tail) if args.verb == "status" else stop(args.run_dir, args.node, args.grace)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
