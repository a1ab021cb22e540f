"""The store a round's workers bootstrap their process group from, opened by the agent of the round's
node 0 before any worker of the round starts: a fresh one every round.

torchrun gives the workers ``MASTER_ADDR``/``MASTER_PORT`` in one of two ways, and dtrain uses neither:

* sharing one worker store, opened in the first round, across every round: a restarted worker reads
  the dead attempt's gloo addresses from it and fails or hangs in ``init_process_group``
  (docs/restarts.md);
* with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, rank 0 opens the store in its own
  ``init_process_group``: every rank that gets there first is refused and waits out TCPStore's
  connect back-off (``bench/join.py``), and every agent, rank 0's too, reads the address and port
  back from the rendezvous store as plain values, which anyone who reaches that store can overwrite.

Here node 0's agent opens the store on a free port of its own address (the one it joined the
rendezvous with) and publishes ``"<addr> <port>"`` through ``publish``; the other agents get it
through ``fetch`` (the elastic rendezvous signs and verifies it with the job's key:
:mod:`dtrain.launch.node.elastic_rdzv`). The workers connect to it as clients
(``TORCHELASTIC_USE_AGENT_STORE=True``: the handlers' ``use_agent_store``). The previous round's
store closes with the agent's last reference to it.

Stdlib at import; torch is imported only by the functions, on the node.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable


def round_store_key(round_: int) -> str:
    """The key, in a round's rendezvous store, under which node 0's agent publishes its worker store."""
    return f"dtrain.worker_store.{int(round_)}"


def endpoint_value(addr: str, port: int) -> str:
    return f"{addr} {int(port)}"


def parse_endpoint(value: str) -> tuple[str, int]:
    """``"<addr> <port>"`` as :func:`endpoint_value` wrote it; ValueError for anything else."""
    addr, sep, port = value.partition(" ")
    if not sep or not addr or " " in port or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a worker store's address and port: {value!r}")
    return addr, int(port)


def open_worker_store(addr: str, timeout: timedelta):
    """A new store for a round's workers, served by this agent on a free port (``.port``): a server only,
    no worker count to wait for (the workers come after this returns)."""
    from torch.distributed import TCPStore

    return TCPStore(addr, 0, None, True, timeout, wait_for_workers=False, multi_tenant=True)


def round_bootstrap(info: Any, *, addr: str, timeout: timedelta, publish: Callable[[str], None],
                    fetch: Callable[[], str]) -> tuple[Any, Any]:
    """(``info`` with the round's worker store as its bootstrap store, that store if this agent opened
    it, else None). ``info`` is what torch's rendezvous returned; ``addr`` is this agent's own address
    (node 0's is the store's); ``publish``/``fetch`` carry the endpoint to the other agents."""
    from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

    server = None
    if info.rank == 0:
        server = open_worker_store(addr, timeout)
        port = server.port
        publish(endpoint_value(addr, port))
    else:
        addr, port = parse_endpoint(fetch())
    return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(addr, port)), server
