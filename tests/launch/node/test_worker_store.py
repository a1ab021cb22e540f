"""Workers bootstrap from a store that node 0's agent opened before they started, a fresh one each round
(dtrain.launch.node.worker_store): the local backend's (dtrain-dynamic) and an elastic job's, whose
address and port are signed with the job's key."""

from __future__ import annotations

import json
import os
import sys

import pytest

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from dtrain.launch.node.worker_store import endpoint_value, parse_endpoint, round_store_key

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


# -- the endpoint node 0's agent publishes ------------------------------------------------------------

def test_an_endpoint_is_an_address_and_a_port_and_nothing_else():
    assert parse_endpoint(endpoint_value("10.0.0.5", 29500)) == ("10.0.0.5", 29500)
    for bad in ("10.0.0.5", "10.0.0.5 0", "10.0.0.5 65536", " 29500", "10.0.0.5 29500 x", "a b c", "h -1"):
        with pytest.raises(ValueError, match="not a worker store's address and port"):
            parse_endpoint(bad)
