"""The lost-node probe (dtrain.launch.core.lost.fault_of) against real loopback sockets: each way a
host's login port can answer, and the fault class it means."""

from __future__ import annotations

import select
import socket
import struct
import threading

import pytest

from dtrain.launch.core.lost import fault_of

PROBE_S = 0.5


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    yield server
    server.close()


def serve_once(server: socket.socket, handle) -> threading.Thread:
    """Accept one connection and hand it to ``handle`` in a thread (joined by the caller)."""
    def run():
        conn, _ = server.accept()
        handle(conn)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def port_of(server: socket.socket) -> int:
    return server.getsockname()[1]


def test_a_refused_port_is_gone(listener):
    port = port_of(listener)
    listener.close()
    assert fault_of("127.0.0.1", port, PROBE_S)[0] == "gone"


def test_a_silent_server_is_frozen(listener):
    """The kernel completes the handshake (the backlog) but no process speaks."""
    fault, detail = fault_of("127.0.0.1", port_of(listener), PROBE_S)
    assert (fault, detail) == ("frozen", f"it accepts connections on port {port_of(listener)} but nothing "
                                         f"answers within {PROBE_S:g} s")


def test_a_server_that_speaks_is_no_fault(listener):
    thread = serve_once(listener, lambda conn: (conn.sendall(b"SSH-2.0-test\r\n"), conn.close()))
    assert fault_of("127.0.0.1", port_of(listener), PROBE_S) is None
    thread.join(5)


def test_a_server_that_closes_at_once_is_gone(listener):
    thread = serve_once(listener, lambda conn: conn.close())
    assert fault_of("127.0.0.1", port_of(listener), PROBE_S)[0] == "gone"
    thread.join(5)


def test_a_connection_reset_before_the_banner_is_gone_not_frozen(listener):
    """A crash kills the host's processes one by one: the probe's connection, queued for an sshd that is
    killed before it accepts it, is reset (CI stop 37 named such a crashed node frozen)."""
    def close_with_the_connection_queued():
        select.select([listener], [], [], 5)  # readable: a connection waits in the backlog
        listener.close()  # the kernel resets what it had queued

    thread = threading.Thread(target=close_with_the_connection_queued, daemon=True)
    thread.start()
    assert fault_of("127.0.0.1", port_of(listener), 5.0)[0] == "gone"
    thread.join(5)


@pytest.mark.parametrize("error", [ConnectionResetError, ConnectionAbortedError])
def test_a_reset_during_the_handshake_is_gone_not_unreachable(monkeypatch, error):
    """The race above, lost one step earlier: the reset arrives before connect() returns. Seen in about 3
    of 100 rounds of the test above on a loaded machine (the probe said ``unreachable``); the kernel's
    timing cannot be forced, so connect() is replaced here by one that fails the way it then does."""
    def reset(address, timeout):
        raise error(104, "Connection reset by peer")
    monkeypatch.setattr("dtrain.launch.core.lost.socket.create_connection", reset)
    assert fault_of("127.0.0.1", 22, PROBE_S) == (
        "gone", "port 22 resets connections: its processes are gone (crashed or rebooted)")


def test_a_server_that_resets_after_accepting_is_gone(listener):
    def reset(conn):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    thread = serve_once(listener, reset)
    assert fault_of("127.0.0.1", port_of(listener), 5.0)[0] == "gone"
    thread.join(5)
