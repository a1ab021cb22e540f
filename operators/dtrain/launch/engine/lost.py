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

The job then ends with :data:`LOST_EXIT_CODE` (ssh's own code for a lost connection), which the
retry policy reads as a lost node (transient: the Airflow retry resumes from the last checkpoint).
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass

#: the exit status of a launch that lost a node (dtrain.launch.engine.retry: a lost node, retried)
LOST_EXIT_CODE = 255
#: a node silent this long is lost (the ssh and slurm options' ``lost_after``): detection within it plus
#: the probe, the node's own fence within it plus the fence grace; the issue's goal is 60 s for both
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
