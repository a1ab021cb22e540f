"""A detached ssh node's lease (detached_node.hold_lease): it fences itself when it cannot reach its peer
for the lease, or when the lease passed unseen (its host was frozen), and never while it reaches its peer
or after its agent ended. Small timings, a real listening socket for the peer."""

from __future__ import annotations

import socket
import threading

from dtrain.launch.node.lease import hold_lease


def run_lease(lease: float, peer, ended: threading.Event | None = None, clock=None, wait: float = 5.0):
    fenced: list[str] = []
    ended = ended or threading.Event()
    kwargs = {"clock": clock} if clock else {}
    thread = threading.Thread(target=hold_lease, args=(lease, peer, ended, fenced.append),
                              kwargs={"check_every": 0.05, **kwargs}, daemon=True)
    thread.start()
    thread.join(wait)
    return fenced, thread


def test_a_node_that_reaches_its_peer_holds_its_lease_and_one_cut_off_fences_after_it():
    listener = socket.create_server(("127.0.0.1", 0))
    peer = listener.getsockname()
    fenced, thread = run_lease(0.5, peer, wait=1.5)  # three leases long, every check reaches the peer
    assert fenced == [] and thread.is_alive()
    listener.close()  # the peer is gone now: refused, as a cut-off node sees it (fast here)
    thread.join(5)
    assert not thread.is_alive() and len(fenced) == 1
    assert fenced[0].startswith(f"this node could not reach its peer 127.0.0.1:{peer[1]} for ")


def test_a_node_fences_at_once_when_the_lease_passed_while_it_was_frozen():
    times = iter([0.0, 0.0, 0.1, 0.2, 100.0])  # the fourth check comes 99.8 s after the third: frozen meanwhile
    fenced, thread = run_lease(30.0, None, clock=lambda: next(times))
    assert not thread.is_alive()
    assert len(fenced) == 1 and fenced[0].startswith("this node was stopped for 100 s (frozen or suspended)")


def test_no_fence_once_the_agent_ended():
    ended = threading.Event()
    ended.set()
    fenced, thread = run_lease(0.2, ("127.0.0.1", 1), ended=ended, wait=2)
    assert fenced == [] and not thread.is_alive()


def test_a_node_whose_own_daemon_stops_answering_fences_after_the_lease():
    """A Slurm node whose slurmd was killed: it still reaches the controller, but nothing could stop its ranks."""
    peer_listener, own_listener = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    peer, own = peer_listener.getsockname(), own_listener.getsockname()
    fenced: list[str] = []
    thread = threading.Thread(target=hold_lease, args=(0.5, peer, threading.Event(), fenced.append),
                              kwargs={"check_every": 0.05, "own": own}, daemon=True)
    thread.start()
    thread.join(1.5)
    assert fenced == [] and thread.is_alive()  # both answer: it holds
    own_listener.close()
    thread.join(5)
    peer_listener.close()
    assert not thread.is_alive() and len(fenced) == 1
    assert fenced[0].startswith(f"this node's own daemon at 127.0.0.1:{own[1]} has not answered for "), fenced
