"""The torchrun agent: ``python -m dtrain.launch.node.torchrun_agent TORCHRUN_ARGS...``.

Runs on every node (started by the ssh, slurm and local backends with the argv that
:mod:`dtrain.launch.core.torchrun` renders): torchrun itself, with the ``dtrain-static``
rendezvous registered (torchrun's static one, restartable: see :func:`restartable_static_handler`)
for fixed membership, ``dtrain-dynamic`` for the local backend's (:func:`restartable_dynamic_handler`),
and ``dtrain-c10d`` for elastic jobs (:mod:`dtrain.launch.node.elastic_rdzv`;
its agent reads the job's secret on stdin first: :func:`dtrain.launch.node.rdzv_auth.read_secret`),
its per-job log directory removed when it ends (torchrun would leave a ``torchelastic_*`` directory
in the temp folder per agent), a stop by signal ending it quietly (torchrun prints a traceback
per agent; the launcher reports the verdict once), and the process ending as soon as torchrun
returns, without the interpreter's teardown of torch (:mod:`dtrain.launch.node.quick_exit`).

Stdlib at import; torch is imported only by the functions, on the node.
"""

from __future__ import annotations

from typing import Any

from dtrain.launch.node.elastic_rdzv import ELASTIC, NO_ROUND_EXIT_CODE, elastic_agent_class, elastic_handler, use_secret
from dtrain.launch.node.worker_store import open_worker_store, round_bootstrap, round_store_key

RESTARTABLE_STATIC = "dtrain-static"
RESTARTABLE_DYNAMIC = "dtrain-dynamic"


def restartable_static_handler(params: Any):
    """torchrun's static rendezvous (fixed membership: every node knows its rank, node 0 hosts the
    store at the endpoint), except that every round after the first gets a fresh store.

    Round 0 is exactly torchrun's static rendezvous: one TCP store at the endpoint, hosted by
    node 0's agent, shared with the workers. At a restart (round k >= 1) node 0's agent starts a
    new store on a free port and publishes the port under a round key in the first store; the
    other agents read it there (waiting for it up to the rendezvous timeout). The workers of round
    k bootstrap from the new store, so no key of a dead attempt can mislead them; the previous
    round's store closes with its last reference.

    As in torchrun's static rendezvous, an agent starts a round when its own workers failed (no
    node is told that another one restarts): with DDP a dead rank makes every other rank fail in
    its next collective, so every node restarts, each once per failure, and the rounds agree.
    """
    import datetime

    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class RestartableStaticRendezvous(RendezvousHandler):
        def __init__(self, addr: str, port: int, rank: int, world_size: int, run_id: str, timeout_s: int):
            self.addr, self.port, self.rank, self.world_size, self.run_id = addr, port, rank, world_size, run_id
            self.timeout = datetime.timedelta(seconds=timeout_s)
            self._first = None  # round 0's store, where later rounds publish their store's port
            self._current = None
            self._round = 0

        def get_backend(self) -> str:
            return RESTARTABLE_STATIC

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self):
            if self._first is None:
                self._first = TCPStore(self.addr, self.port, self.world_size, self.rank == 0, self.timeout,
                                       multi_tenant=True)
            round_, self._round = self._round, self._round + 1
            store, port = self._first, self.port
            if round_:
                key = f"dtrain/{self.run_id}/round{round_}/port"
                if self.rank == 0:
                    store = open_worker_store(self.addr, self.timeout)
                    port = store.port
                    self._first.set(key, str(port))
                else:
                    port = int(self._first.get(key).decode())
                    store = TCPStore(self.addr, port, None, False, self.timeout)
            self._current = store
            return RendezvousInfo(PrefixStore(self.run_id, store), self.rank, self.world_size,
                                  RendezvousStoreInfo(self.addr, port))

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self.run_id

        def shutdown(self) -> bool:
            return True

    addr, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    if port == -1:
        raise ValueError(f"{RESTARTABLE_STATIC} rendezvous: no port in endpoint {params.endpoint!r}")
    return RestartableStaticRendezvous(addr, port, params.get_as_int("rank"), params.max_nodes, params.run_id,
                                       params.get_as_int("timeout", 600))


def restartable_dynamic_handler(params: Any):
    """torchrun's c10d (dynamic) rendezvous, whose workers bootstrap from a store that node 0's agent
    opens afresh every round, before any worker of the round starts
    (:mod:`dtrain.launch.node.worker_store`: why neither of torchrun's own ways).

    The rendezvous itself runs as with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    (:data:`dtrain.launch.core.torchrun.AGENT_ENV`: torch keeps no worker store across rounds); node
    0's agent then publishes its store's address and port in the round's own rendezvous store, where
    the other agents read them. The local backend's rendezvous store is torch's own, on this host, and
    believes anyone who reaches it, as torch's c10d rendezvous does."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import RendezvousHandler
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class FreshWorkerStore(RendezvousHandler):
        def __init__(self, inner, timeout: timedelta):
            self.inner, self.timeout = inner, timeout
            self.worker_store = None  # node 0's store of the current round

        def get_backend(self) -> str:
            return RESTARTABLE_DYNAMIC

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self):
            info = self.inner.next_rendezvous()
            key = round_store_key(self.inner._state_holder.state.round)
            self.worker_store = None  # the previous round's store closes
            info, self.worker_store = round_bootstrap(
                info, addr=self.inner._this_node.addr, timeout=self.timeout,
                publish=lambda value: info.store.set(key, value),
                fetch=lambda: info.store.get(key).decode(errors="replace"))
            return info

        def is_closed(self) -> bool:
            return self.inner.is_closed()

        def set_closed(self) -> None:
            self.inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return self.inner.num_nodes_waiting()

        def get_run_id(self) -> str:
            return self.inner.get_run_id()

        def shutdown(self) -> bool:
            return self.inner.shutdown()

    backend, store = create_backend(params)
    return FreshWorkerStore(create_handler(store, backend, params),
                            timedelta(seconds=params.get_as_int("join_timeout", 600)))


def main(argv: list[str] | None = None) -> None:
    """torchrun (same arguments, same exit status) with :data:`RESTARTABLE_STATIC` registered.

    torchrun fills in the endpoint (from ``--master-addr``/``--master-port``, i.e. PET_MASTER_*)
    and the node rank (``--node-rank``, PET_NODE_RANK) only for its own ``static`` backend; done
    here the same way for ``dtrain-static``.

    Without ``--log-dir`` torchrun makes a ``torchelastic_*`` directory in the temp folder for its
    workers' error files and never removes it (one per agent per job); here the agent gets a
    private one that goes with it, and removes those of agents that were killed
    (:mod:`dtrain.launch.node.agent_logs`). A stop (SIGTERM/SIGINT/SIGHUP from the launcher's teardown, a
    hang verdict, a cancel) still stops the workers as torchrun does, then exits 128 + the signal
    without torchrun's traceback: every agent printed one, and the launcher reports the verdict."""
    import os
    import shutil
    import sys

    from dtrain.launch.node import agent_logs
    from dtrain.launch.node.proctree import die_with_parent

    die_with_parent(os.environ)  # before torch's import: seconds in which the parent may die
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, rendezvous_handler_registry

    rendezvous_handler_registry.register(RESTARTABLE_STATIC, restartable_static_handler)
    rendezvous_handler_registry.register(RESTARTABLE_DYNAMIC, restartable_dynamic_handler)
    rendezvous_handler_registry.register(ELASTIC, elastic_handler)
    args = torchrun.parse_args(argv)
    if args.rdzv_backend == ELASTIC:  # its agent: a lost member's restart is not the script's failure
        from torch.distributed.launcher import api as launcher_api

        from dtrain.launch.node.netif import source_address
        from dtrain.launch.node.rdzv_auth import read_secret

        try:  # the job's secret, on stdin (then /dev/null: the workers inherit nothing)
            use_secret(read_secret(0))
        except ValueError as e:
            sys.exit(f"[dtrain] the elastic agent cannot sign its rendezvous: {e}")

        launcher_api.LocalElasticAgent = elastic_agent_class()
        if not args.local_addr:  # the address this node reaches the store from: where its peers reach it
            args.local_addr = source_address(args.rdzv_endpoint.rpartition(":")[0].strip("[]"))
    if args.rdzv_backend == RESTARTABLE_STATIC:
        if not args.rdzv_endpoint:
            args.rdzv_endpoint = f"{args.master_addr}:{args.master_port or 29500}"
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"rank={args.node_rank}"]))
        args.node_rank = 0  # now in the rendezvous config; torchrun would warn that it ignores it
    private_log_dir = None
    if not args.log_dir:
        agent_logs.sweep()  # what killed agents on this host left
        args.log_dir = private_log_dir = agent_logs.make()
    try:
        record(torchrun.run)(args)
    except SignalException as e:
        sys.exit(128 + int(e.sigval))
    except RendezvousClosedError:
        # an elastic job's node that was waiting for the next round when the job ended: nothing to do
        print("[dtrain] the job ended before this node's next round", file=sys.stderr, flush=True)
        sys.exit(NO_ROUND_EXIT_CODE)
    finally:
        if private_log_dir is not None:
            shutil.rmtree(private_log_dir, ignore_errors=True)


if __name__ == "__main__":
    from dtrain.launch.node.quick_exit import run_then_exit

    run_then_exit(main)  # the job is over when main returns: no interpreter teardown of torch per agent
