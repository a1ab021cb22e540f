"""The rendezvous store of an elastic job, hosted on the submitting host, never on a training node.

An elastic job (``nodes="MIN:MAX"``) must survive the loss of any node, so its c10d rendezvous
store cannot live on one of them (torchrun's default: node 0's agent hosts it, and the job dies
with node 0). The launcher starts this small process next to itself::

    python -m dtrain.launch.engine.rdzv_store PORT

It hosts a TCPStore on PORT (chosen free by the backend's dry run; every interface: the nodes reach it
at the launcher's address on their route, :func:`store_address`), prints
``port=N`` and serves until its stdin closes (the launcher ended it, or died: the pipe closes with
it) or it is signalled; it also dies with its parent
(:func:`~dtrain.launch.node.proctree.die_with_parent`). Meanwhile it reads the launcher's word on
stdin, ``lost N`` / ``back N``, and keeps the list of lost nodes in the store for the agents
(:data:`~dtrain.launch.node.elastic_rdzv.LOST_KEY`). :class:`RendezvousStore` is the launcher's side.
Stdlib at import: torch is imported only in the store's own process.
"""

from __future__ import annotations

import collections
import os
import select
import subprocess
import sys
import threading
import time

from dtrain.errors import LaunchError
from dtrain.launch.node.elastic_rdzv import LOST_KEY
from dtrain.launch.node.netif import source_address
from dtrain.launch.node.proctree import PARENT_ENV

PORT_PREFIX = "port="
START_TIMEOUT_S = 60.0  # torch's import on a loaded host


def store_address(node: str) -> str:
    """The address at which node ``node`` reaches a server on this host: ours on the route to it."""
    address = source_address(node)
    if address is None:
        raise LaunchError(f"no route from this host to {node}: its agent could not reach the rendezvous store here", 1)
    return address


class RendezvousStore:
    """The store process, started by :meth:`start` and ended by :meth:`stop` (idempotent)."""

    def __init__(self, python: str = sys.executable):
        self.python = python
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.errors: collections.deque = collections.deque(maxlen=20)  # its last lines on stderr
        self._lock = threading.Lock()

    def _drain(self, stream) -> None:
        """Keep reading the store's stderr (torch's warnings), so that it never blocks on a full pipe."""
        with stream:
            for raw in iter(stream.readline, b""):
                self.errors.append(raw.decode(errors="replace").rstrip())

    def start(self, port: int) -> int:
        env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
        self.proc = subprocess.Popen([self.python, "-m", __name__, str(int(port))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
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


def serve() -> None:
    from dtrain.launch.node.proctree import die_with_parent

    die_with_parent(os.environ)
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("0.0.0.0", int(sys.argv[1]), None, True, timedelta(seconds=60), wait_for_workers=False,
                     multi_tenant=True)
    lost: set[int] = set()
    store.set(LOST_KEY, "")
    print(f"{PORT_PREFIX}{store.port}", flush=True)
    for line in sys.stdin:  # until the launcher closes the pipe (or dies)
        word, _, node = line.strip().partition(" ")
        if node.isdigit() and word in ("lost", "back"):
            (lost.add if word == "lost" else lost.discard)(int(node))
            store.set(LOST_KEY, ",".join(map(str, sorted(lost))))
    del store


if __name__ == "__main__":
    serve()
