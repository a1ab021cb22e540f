"""Ports (chosen per job so concurrent jobs never collide) and this host's address towards another."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def address_towards(destination: str) -> str:
    """This host's address on the route to ``destination`` (no packet is sent): where a peer there
    reaches a server of ours. Loopback for a loopback destination."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((destination, 9))
        return s.getsockname()[0]
