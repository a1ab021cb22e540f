"""Workers bootstrap from a store that node 0's agent opened before they started, a fresh one each round
(dtrain.launch.node.worker_store): the local backend's (dtrain-dynamic) and an elastic job's, whose
address and port are signed with the job's key."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from dtrain.launch.node.worker_store import endpoint_value, parse_endpoint, round_store_key
from tests.launch.core.test_elastic import rendezvous  # noqa: F401 (the fixture: dtrain-c10d handlers at a real store)

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "worker_store_probe.py")


@pytest.mark.timeout(180)
def test_every_rank_finds_its_rounds_store_listening_and_a_restart_gets_a_new_one(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spec = LaunchSpec(command=[sys.executable, PROBE, str(out)], nodes=2, procs_per_node=2, backend="local",
                      device="cpu", run_dir=str(tmp_path / "run"), max_restarts=1)
    lines: list[str] = []
    result = Launcher(spec, sink=lines.append).run()
    assert result.exit_code == 0, "\n".join(lines[-40:])
    seen = {name: json.loads((out / name).read_text()) for name in sorted(os.listdir(out))}
    assert sorted(seen) == [f"attempt{a}-rank{r}.json" for a in (0, 1) for r in range(4)]
    # Before any rank imported torch, its store already accepted connections: no rank waits on
    # TCPStore's connect back-off for rank 0 to open it.
    assert all(s["listening"] and s["agent_store"] == "True" for s in seen.values()), seen
    ports = [{s["port"] for name, s in seen.items() if name.startswith(f"attempt{a}-")} for a in (0, 1)]
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1], ports  # one store a round, a new one


# -- the elastic rendezvous: the endpoint is signed ---------------------------------------------------

def test_an_endpoint_is_an_address_and_a_port_and_nothing_else():
    assert parse_endpoint(endpoint_value("10.0.0.5", 29500)) == ("10.0.0.5", 29500)
    for bad in ("10.0.0.5", "10.0.0.5 0", "10.0.0.5 65536", " 29500", "10.0.0.5 29500 x", "a b c", "h -1"):
        with pytest.raises(ValueError, match="not a worker store's address and port"):
            parse_endpoint(bad)


@pytest.fixture
def store():
    from datetime import timedelta

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=30))
    del server


def test_a_planted_endpoint_is_refused_named_once_and_the_signed_one_taken(store, capfd):
    from datetime import timedelta

    from dtrain.launch.node.elastic_rdzv import wait_signed
    from dtrain.launch.node.rdzv_auth import StoreKey

    key, name = StoreKey("5e" * 32), round_store_key(3)
    store.set(name, b"203.0.113.9 1")  # a plain value, as torch's own MASTER_ADDR/PORT are
    later = threading.Timer(0.6, lambda: store.set(name, key.seal(name, b"127.0.0.1 4242")))
    later.start()
    try:
        assert wait_signed(store, key, name, timedelta(seconds=20)) == b"127.0.0.1 4242"
    finally:
        later.cancel()
    named = [line for line in capfd.readouterr().err.splitlines() if f"refused the value of {name!r}" in line]
    assert key.refusals == 1 and len(named) == 1, named  # polled many times, named once
    replayed = round_store_key(4)  # round 3's signed value copied under round 4's key
    store.set(replayed, store.get(name))
    with pytest.raises(TimeoutError, match=repr(replayed)):
        wait_signed(store, key, replayed, timedelta(seconds=1))


@pytest.mark.timeout(120)
def test_elastic_workers_bootstrap_from_node_0s_signed_store_whatever_torchs_plain_keys_say(rendezvous):
    """Someone who reaches the rendezvous store keeps overwriting the plain MASTER_ADDR and MASTER_PORT
    keys torch would hand the workers: every node's workers are still given node 0's agent's store."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    nodes = [rendezvous(0), rendezvous(1)]
    attacker = TCPStore("127.0.0.1", nodes[0]._store.port, None, False, timedelta(seconds=30))
    prefix = "torch.rendezvous.job-joins.0/"
    stop = threading.Event()

    def overwrite():
        while not stop.is_set():
            attacker.set(prefix + "MASTER_ADDR", "203.0.113.9")
            attacker.set(prefix + "MASTER_PORT", "1")
            time.sleep(0.001)

    threads = [threading.Thread(target=overwrite, daemon=True)]
    infos: dict[int, object] = {}
    threads += [threading.Thread(target=lambda i=i: infos.update({i: nodes[i].next_rendezvous()}), daemon=True)
                for i in (0, 1)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads[1:]:
            thread.join(90)
    finally:
        stop.set()
        threads[0].join(10)
    assert sorted(infos) == [0, 1]
    host = next(n for n in nodes if n.worker_store is not None)  # group rank 0's agent
    assert [n.worker_store is None for n in nodes].count(True) == 1
    for info in infos.values():
        assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == (
            "127.0.0.1", host.worker_store.port)
    assert all(n.use_agent_store for n in nodes)
    socket.create_connection(("127.0.0.1", host.worker_store.port), timeout=5).close()  # it listens
