"""The rendezvous store of an elastic job, hosted on the submitting host, never on a training node.

An elastic job (``nodes="MIN:MAX"``) must survive the loss of any node, so its c10d rendezvous
store cannot live on one of them (torchrun's default: node 0's agent hosts it, and the job dies
with node 0). The launcher starts this small process next to itself::

    python -m dtrain.launch.core.rdzv_store HOST PORT

It reads the job's secret on stdin first (one line: :func:`~dtrain.launch.node.rdzv_auth.read_secret`),
then hosts a TCPStore on PORT (chosen free by the backend's dry run), listening on HOST only: the
launcher's address on the nodes' route (:func:`store_address`; loopback for the local backend), never
every interface. It prints ``port=N`` and serves until its stdin closes (the launcher ended it, or died:
the pipe closes with it) or it is signalled; it also dies with its parent
(:func:`~dtrain.launch.node.proctree.die_with_parent`). Meanwhile it reads the launcher's word on
stdin, ``lost N`` / ``back N``, and keeps the list of lost nodes in the store for the agents
(:data:`~dtrain.launch.node.elastic_rdzv.LOST_KEY`), signed with the job's secret; every
:data:`WATCH_S` it looks at that value, and one that is not its own (overwritten by someone who
reached the port) is named in the log, counted and written back. :class:`RendezvousStore` is the
launcher's side; it passes the store's tampering reports on to the job's log.
Stdlib at import: torch is imported only in the store's own process.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import subprocess
import sys
import threading
import time

from dtrain.errors import LaunchError
from dtrain.launch.node.elastic_rdzv import LOST_KEY, lost_value
from dtrain.launch.node.netif import source_address
from dtrain.launch.node.proctree import PARENT_ENV
from dtrain.launch.node.rdzv_auth import StoreKey, read_secret, secret_line

PORT_PREFIX = "port="
START_TIMEOUT_S = 60.0  # torch's import on a loaded host
#: seconds between two looks of the store process at the lost list it keeps
WATCH_S = 0.5
#: the store's stderr lines that go to the job's log (the rest: torch's warnings, kept for a failed start)
REPORT_PREFIX = "[dtrain] "


def store_address(node: str) -> str:
    """The address at which node ``node`` reaches a server on this host: ours on the route to it."""
    address = source_address(node)
    if address is None:
        raise LaunchError(f"no route from this host to {node}: its agent could not reach the rendezvous store here", 1)
    return address


class RendezvousStore:
    """The store process, started by :meth:`start` and ended by :meth:`stop` (idempotent)."""

    def __init__(self, python: str = sys.executable, sink=None):
        self.python, self.sink = python, sink
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.errors: collections.deque = collections.deque(maxlen=20)  # its last lines on stderr
        self._lock = threading.Lock()

    def _drain(self, stream) -> None:
        """Keep reading the store's stderr (torch's warnings), so that it never blocks on a full pipe."""
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                self.errors.append(line)
                if line.startswith(REPORT_PREFIX) and self.sink is not None:
                    self.sink(line[:500])

    def start(self, host: str, port: int, secret: str) -> int:
        """Start the store at ``host``:``port`` (the address the agents use), keyed with the job's ``secret``."""
        env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
        self.proc = subprocess.Popen([self.python, "-m", __name__, host, str(int(port))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
        self.proc.stdin.write(secret_line(secret))
        self.proc.stdin.flush()
        drain = threading.Thread(target=self._drain, args=(self.proc.stderr,), name="dtrain-rdzv-store", daemon=True)
        drain.start()
        deadline, line = time.monotonic() + START_TIMEOUT_S, b""
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                break
        text = line.decode(errors="replace").strip()
        if not text.startswith(PORT_PREFIX) or not text[len(PORT_PREFIX):].isdigit():
            self.stop()
            drain.join(timeout=5)
            error = "; ".join(self.errors)[-500:]
            raise LaunchError(f"the elastic rendezvous store did not start: {text or error or 'no answer'}", 1)
        self.port = int(text[len(PORT_PREFIX):])
        return self.port

    def lost(self, node: int) -> None:
        """Tell the job's agents that node ``node`` is lost (:data:`~dtrain.launch.node.elastic_rdzv.LOST_KEY`):
        the survivors re-form the round without waiting for its keep-alive to lapse."""
        self._say(f"lost {int(node)}")

    def back(self, node: int) -> None:
        """Take node ``node`` off the lost list: its agent is about to start again."""
        self._say(f"back {int(node)}")

    def _say(self, line: str) -> None:
        with self._lock:
            if self.proc is None:
                return
            try:
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
            except (OSError, ValueError):
                pass  # it ended: stop() reports nothing more; the keep-alive still drops the node

    def stop(self) -> None:
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # its lifeline: it exits on EOF
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # stderr: its drain thread ends at EOF


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` only (TCPStore's own server listens on every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(socket.SOMAXCONN)
    return sock


class LostList:
    """The lost nodes as the store process keeps them in the store: signed, and watched for tampering."""

    def __init__(self, store, key: StoreKey):
        self.store, self.key = store, key
        self.lost: set[int] = set()
        self.sequence = 0
        self.lock = threading.Lock()
        self.signed = b""
        self._write()

    def _write(self) -> None:
        self.signed = self.key.seal(LOST_KEY, lost_value(self.sequence, self.lost))
        self.store.set(LOST_KEY, self.signed)

    def hear(self, word: str, node: int) -> None:
        with self.lock:
            (self.lost.add if word == "lost" else self.lost.discard)(node)
            self.sequence += 1
            self._write()

    def watch(self, stop: threading.Event) -> None:
        """Every WATCH_S: a value that is not ours (someone else wrote it) is refused, logged and replaced."""
        while not stop.wait(WATCH_S):
            with self.lock:
                current = self.store.get(LOST_KEY) if self.store.check([LOST_KEY]) else b""
                if current != self.signed:
                    self.key.refuse_once(LOST_KEY, current, "overwritten in the store; written back")
                    self._write()


def serve() -> None:
    from dtrain.launch.node.proctree import die_with_parent

    die_with_parent(os.environ)
    key = StoreKey(read_secret(0, close=False))  # stdin stays open: the launcher's word follows
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, port = sys.argv[1], int(sys.argv[2])
    sock = listening_socket(host, port)
    store = TCPStore(host, sock.getsockname()[1], None, True, timedelta(seconds=60), wait_for_workers=False,
                     multi_tenant=True, master_listen_fd=sock.fileno())
    lost = LostList(store, key)
    stop = threading.Event()
    threading.Thread(target=lost.watch, args=(stop,), name="dtrain-rdzv-watch", daemon=True).start()
    print(f"{PORT_PREFIX}{store.port}", flush=True)
    for line in sys.stdin:  # until the launcher closes the pipe (or dies)
        word, _, node = line.strip().partition(" ")
        if node.isdigit() and word in ("lost", "back"):
            lost.hear(word, int(node))
    stop.set()
    del store


if __name__ == "__main__":
    serve()
