"""Runs on each SSH host: ``python -m dtrain.launch.backends.ssh.remote_agent [options] -- AGENT ARGV...``.

The SSH backend starts this over ssh, once per host. It

* makes itself a session and process-group leader (``setsid``; sshd usually already
  did), so the whole node can be signalled with ``kill -TERM -- -PGID``;
* announces that pgid on stdout (``[dtrain-remote] nonce=X node=N pgid=P``, which the
  launcher reads from the stream) and in ``--pgid-file``. ``X`` is the job's secret nonce,
  read from stdin with the environment and never passed to the agent's children, so a
  rank printing a look-alike line cannot steer the launcher's teardown;
* reads one JSON line from stdin with the job's environment, so variables (possibly
  secrets) never appear in an argv, on this host or the launcher's; an elastic job's line also
  holds the job's secret, which goes on to the agent's stdin only (its rendezvous signs with it);
* runs the torchrun agent (argv, no shell) in its process group and exits with its code;
* keeps reading stdin as a lifeline: EOF means the launcher or its ssh client is gone
  (even SIGKILLed), and then, as on SIGTERM/SIGINT/SIGHUP, it stops every descendant
  (torchrun puts workers in sessions of their own, so the group alone is not enough):
  SIGTERM, the grace period (``--grace``: the spec's stop_grace, the ranks' time to save a
  checkpoint; over as soon as every descendant is gone), SIGKILL;
* holds a lease (``--lease S``): the launcher writes a newline on stdin every few seconds, and
  when nothing has arrived for S seconds this node is cut off from its launcher (a partition,
  a launcher host that died without closing the connection, this host frozen and thawed): it
  **fences itself**, stopping every descendant as above but with a grace of ``FENCE_GRACE_S`` (cut
  off, no rank can reach a checkpoint), so no rank of a job the launcher has
  given up on runs on (holding GPUs) or collides with the retry when the network heals. It
  leaves ``fenced-node<N>`` in the pgid file's folder (the run directory) saying when and why.

Stdlib at import; psutil (a dependency of the package) only when tearing down.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from dtrain.launch.node.lease import FENCE_GRACE_S
from dtrain.launch.node.proctree import kill_tree
from dtrain.launch.node.rdzv_auth import secret_line
from dtrain.rundir import RunDir

ANNOUNCE = "[dtrain-remote]"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="remote_agent")
    p.add_argument("--job-id", required=True, help="for the record (and to find this process)")
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--pgid-file", help="where to write this node's process-group id")
    p.add_argument("--workdir", help="working directory of the agent")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--lease", type=float, default=0.0,
                   help="fence this node when the launcher has written nothing on stdin for this many seconds (0: never)")
    p.add_argument("agent", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.agent[:1] == ["--"]:
        args.agent = args.agent[1:]
    if not args.agent:
        p.error("the agent command is missing after --")
    return args


def free_port() -> int:
    """Used by the launcher's probe: a port free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def read_line(fd: int, limit: int = 1 << 20) -> str:
    """One line from ``fd``, byte by byte: nothing past the newline is consumed (the rest
    of stdin is the lifeline)."""
    data = bytearray()
    while len(data) < limit:
        chunk = os.read(fd, 1)
        if not chunk or chunk == b"\n":
            break
        data += chunk
    return data.decode()


class RemoteNode:
    def __init__(self, args: argparse.Namespace, nonce: str = "", secret: str = ""):
        self.args = args
        self.nonce = nonce
        self.secret = secret  # an elastic agent's: it reads it on its stdin (never its environment)
        self.child: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.done = threading.Event()

    def announce(self) -> None:
        pgid = os.getpgrp()
        if self.args.pgid_file:
            path = os.path.abspath(self.args.pgid_file)  # in the run directory: dtrain.rundir writes it
            RunDir(os.path.dirname(path)).write(os.path.basename(path), data=f"{pgid}\n".encode())
        print(f"{ANNOUNCE} nonce={self.nonce} node={self.args.node} pgid={pgid} host={socket.gethostname()}",
              flush=True)

    def start(self, env: dict[str, str]) -> None:
        environ = dict(os.environ)
        environ.update(env)
        self.child = subprocess.Popen(self.args.agent, env=environ, cwd=self.args.workdir or None,
                                      stdin=subprocess.PIPE if self.secret else subprocess.DEVNULL)
        if self.secret:
            try:
                self.child.stdin.write(secret_line(self.secret))
                self.child.stdin.close()
            except BrokenPipeError:
                pass  # it ended already: its exit status reports it

    def lifeline(self) -> None:
        # The raw fd, not sys.stdin: a daemon thread blocked in a buffered read aborts
        # interpreter shutdown ("could not acquire lock for <stdin>").
        lease = self.args.lease if self.args.lease > 0 else None
        while True:
            try:
                readable, _, _ = select.select([0], [], [], lease)
                if not readable:  # the lease lapsed: nothing from the launcher for that long
                    if not self.done.is_set():
                        self.fence(f"no word from the launcher for {lease:g} s (its lease lapsed): "
                                   f"this node is cut off; fencing it")
                    return
                if not os.read(0, 4096):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        if not self.done.is_set():
            self.stop("launcher connection closed")

    def fence(self, reason: str) -> None:
        """Stop this node's ranks because its launcher cannot be reached; record why in the run directory
        (the launcher cannot hear it now; whoever looks later can)."""
        if self.args.pgid_file:
            path = os.path.abspath(self.args.pgid_file)
            try:
                RunDir(os.path.dirname(path)).write(
                    f"fenced-node{self.args.node}", data=json.dumps({"time": time.time(), "reason": reason}).encode())
            except (OSError, ValueError):
                pass  # the fence matters, not its record
        self.stop(reason, grace=min(self.args.grace, FENCE_GRACE_S))

    def stop(self, reason: str, grace: float | None = None) -> None:
        """Stop every descendant (their grace: ``--grace`` unless given); idempotent, callable from a
        signal handler (work runs in a thread)."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        threading.Thread(target=self._kill_tree, args=(grace,), daemon=True).start()
        try:
            print(f"{ANNOUNCE} node={self.args.node} stopping: {reason}", file=sys.stderr, flush=True)
        except OSError:  # nobody reads any more (the session ended: a frozen host thawed late): stop all the same
            pass

    def _kill_tree(self, grace: float | None = None) -> None:
        import psutil

        grace = self.args.grace if grace is None else grace
        kill_tree(psutil.Process(), grace, self.args.job_id, self.args.node)  # and what left the tree

    def wait(self) -> int:
        code = self.child.wait()
        self.done.set()
        # Anything the agent left behind (a worker stuck in its own session) goes too.
        self.stopping.clear()
        self._kill_tree()
        if self.args.pgid_file:
            path = os.path.abspath(self.args.pgid_file)
            try:
                RunDir(os.path.dirname(path)).remove(os.path.basename(path))
            except (OSError, ValueError):
                pass
        return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if os.getpgrp() != os.getpid():
        os.setsid()
    line = read_line(0)
    try:
        payload = json.loads(line) if line.strip() else {}
        env, nonce = dict(payload.get("env", {})), str(payload.get("nonce", ""))
        secret = str(payload.get("secret", ""))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"{ANNOUNCE} node={args.node}: bad environment line on stdin ({e})", file=sys.stderr, flush=True)
        return 2
    node = RemoteNode(args, nonce, secret)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda s, _f: node.stop(f"signal {s}"))
    node.announce()
    if node.stopping.is_set():
        return 128 + signal.SIGTERM
    node.start(env)
    if node.stopping.is_set():  # a signal raced the start: the tree must not survive it
        node._kill_tree()
    threading.Thread(target=node.lifeline, daemon=True).start()
    return node.wait()


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no interpreter shutdown racing the lifeline thread
