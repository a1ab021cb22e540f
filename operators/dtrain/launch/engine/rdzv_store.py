"""The rendezvous store of an elastic job, hosted on the submitting host, never on a training node.

An elastic job (``nodes="MIN:MAX"``) must survive the loss of any node, so its c10d rendezvous
store cannot live on one of them (torchrun's default: node 0's agent hosts it, and the job dies
with node 0). The launcher starts this small process next to itself::

    python -m dtrain.launch.engine.rdzv_store PORT

It hosts a TCPStore on PORT (chosen free by the backend's dry run; every interface: the nodes reach it at the launcher's address
on their route, :func:`address_towards`), prints ``port=N`` and serves until its stdin closes (the
launcher ended it, or died: the pipe closes with it) or it is signalled; it also dies with its
parent (:func:`~dtrain.launch.node.proctree.die_with_parent`). :class:`RendezvousStore` is the
launcher's side. Stdlib at import: torch is imported only in the store's own process.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

from dtrain.errors import LaunchError
from dtrain.launch.node.proctree import PARENT_ENV

PORT_PREFIX = "port="
START_TIMEOUT_S = 60.0  # torch's import on a loaded host


def address_towards(destination: str) -> str:
    """This host's address on the route to ``destination`` (no packet is sent): where a node there
    reaches a server of ours. Loopback for a loopback destination."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((destination, 9))
        return s.getsockname()[0]


class RendezvousStore:
    """The store process, started by :meth:`start` and ended by :meth:`stop` (idempotent)."""

    def __init__(self, python: str = sys.executable):
        self.python = python
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    def start(self, port: int) -> int:
        env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
        self.proc = subprocess.Popen([self.python, "-m", __name__, str(int(port))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, start_new_session=True)
        deadline, line = time.monotonic() + START_TIMEOUT_S, b""
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                break
        text = line.decode(errors="replace").strip()
        if not text.startswith(PORT_PREFIX) or not text[len(PORT_PREFIX):].isdigit():
            error = self.proc.stderr.read().decode(errors="replace")[-500:] if self.proc.poll() is not None else ""
            self.stop()
            raise LaunchError(f"the elastic rendezvous store did not start: {text or error or 'no answer'}", 1)
        self.port = int(text[len(PORT_PREFIX):])
        return self.port

    def stop(self) -> None:
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
        for stream in (proc.stdout, proc.stderr):
            stream.close()


def serve() -> None:
    from dtrain.launch.node.proctree import die_with_parent

    die_with_parent(os.environ)
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("0.0.0.0", int(sys.argv[1]), None, True, timedelta(seconds=60), wait_for_workers=False, multi_tenant=True)
    print(f"{PORT_PREFIX}{store.port}", flush=True)
    sys.stdin.buffer.read()  # until the launcher closes the pipe (or dies)
    del store


if __name__ == "__main__":
    serve()
