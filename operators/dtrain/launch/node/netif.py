"""The network interface that reaches the rendezvous host: the one gloo and NCCL must use on this node.

Left to themselves, gloo and NCCL's socket transport pick an address their own way: gloo advertises
the address the machine's hostname resolves to, which on many images is 127.0.0.1 (``Gloo
connectFullMesh failed ... remote=[127.0.0.1]`` across hosts); NCCL takes the first interface that
is up, which on a host with a management or container interface listed first is the wrong one. The
interface this node's own routing table uses to reach MASTER_ADDR is the one that reaches the other
nodes, so each rank's wrapper sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` to it on every
node, unless the user set them (their value is kept, whatever it is). Each node decides for itself:
interface names differ between hosts (``eth0`` on one, ``ens5`` on another).

How: a UDP socket "connected" to MASTER_ADDR sends nothing, but the kernel picks the source address
its route would use; the interface holding that address is the answer. MASTER_ADDR on this node
itself gives the interface holding that address (not ``lo``, through which the kernel would route it:
the other nodes reach this one at that address).
"""

from __future__ import annotations

import socket
from typing import Mapping

#: what the ranks' collective libraries read to choose their interface
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: any port: a UDP connect sends nothing, it only asks the kernel for a route
_PROBE_PORT = 9


def source_address(host: str) -> str | None:
    """The address this node would send from to reach ``host`` (a name or an address); None when
    ``host`` does not resolve or no route reaches it."""
    try:
        infos = socket.getaddrinfo(host, _PROBE_PORT, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(sockaddr)
                return probe.getsockname()[0]
        except OSError:
            continue
    return None


#: Linux gives the loopback device this index in every network namespace (LOOPBACK_IFINDEX)
LOOPBACK_IFINDEX = 1


def interface_with_address(address: str) -> str | None:
    """The interface that holds ``address`` (None when none does)."""
    wanted = address.split("%", 1)[0]  # an IPv6 link-local address carries its zone
    if wanted.startswith("127.") or wanted == "::1":
        # loopback (a one-host job): the kernel holds it on its loopback device, so every rank of a
        # local job skips psutil's import and the listing of every interface
        try:
            return socket.if_indextoname(LOOPBACK_IFINDEX)
        except OSError:
            pass
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.family in (socket.AF_INET, socket.AF_INET6) and entry.address.split("%", 1)[0] == wanted:
                return name
    return None


def interface_to(host: str) -> str | None:
    """The interface this node reaches ``host`` through (None when it cannot tell)."""
    source = source_address(host)
    return interface_with_address(source) if source else None


def socket_ifname_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for a rank whose environment is ``environ``: the
    interface toward its MASTER_ADDR, for each of the two the environment does not set already; {}
    without a MASTER_ADDR or when no interface is found (the libraries then choose as they would)."""
    missing = [name for name in SOCKET_IFNAME_VARS if not environ.get(name)]
    master = environ.get("MASTER_ADDR", "")
    if not missing or not master:
        return {}
    interface = interface_to(master)
    return {name: interface for name in missing} if interface else {}
