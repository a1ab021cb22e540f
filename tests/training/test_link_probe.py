"""The link probe (dtrain.training.collectives.probe_links) and the stall report's SlowLink rule.

The rule from probe records written by hand; the probe itself in a real 2-process gloo job on this host
(two "nodes" of one rank, DTRAIN_NODE_INDEX set as the launcher sets it), and through the stall report
from the metrics files it writes. tests/launch/engine/faults/test_straggler_sweep.py runs it on hosts with their own
addresses, one of them behind a rate-limited link."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dtrain.stall_report import format_report, summarize, summarize_records
from dtrain.training.collectives import _ring_peers

from .test_straggler_report import two_by_two


def probe(node: int, source: int, seconds: float, size: int = 1 << 20) -> dict:
    return {"node": node, "link_from_node": source, "link_bytes": size, "link_seconds": seconds}


def links(*seconds: float, ranks_per_node: int = 1) -> dict[int, dict]:
    """Each node's ranks' probes: node n received from node n-1 in ``seconds[n]``."""
    nodes = len(seconds)
    return {node * ranks_per_node + local: probe(node, (node - 1) % nodes, seconds[node])
            for node in range(nodes) for local in range(ranks_per_node)}


def test_the_link_into_a_node_is_named_and_never_a_healthy_one():
    summary = summarize_records(two_by_two(slow_node=None, comm_s=0.2), links=links(0.002, 0.42, ranks_per_node=2))
    rule = summary["rules"]["SlowLink"]
    assert (rule["triggered"], rule["nodes"], rule["from_nodes"]) == (True, [1], [0])
    assert summary["flags"] == ["CommunicationBound", "SlowLink"]
    assert summary["rules"]["LoadBalancing"]["nodes"] == []  # a node behind a slow link is no straggler
    line = next(line for line in format_report(summary) if line.startswith("[stall] SlowLink"))
    assert line == ("[stall] SlowLink: TRIGGERED on the link into node 1 (from node 0): 2.5 MB/s; the other nodes "
                    "receive 524.3 MB/s (threshold: a third as fast, and 50 ms longer a transfer)")
    three = summarize_records(two_by_two(slow_node=None), links=links(0.003, 0.004, 0.4))["rules"]["SlowLink"]
    assert (three["triggered"], three["nodes"], three["from_nodes"]) == (True, [2], [1])


@pytest.mark.parametrize("seconds, why", [
    ((0.002, 0.008), "4x slower but 6 ms longer: scheduling noise on a fast link"),
    ((0.30, 0.42), "0.42 s against 0.30 s: slower, but not a third as fast"),
])
def test_noise_and_small_differences_name_no_link(seconds, why):
    rule = summarize_records(two_by_two(slow_node=None), links=links(*seconds))["rules"]["SlowLink"]
    assert (rule["triggered"], rule["nodes"]) == (False, []), why
    assert rule["message"].startswith("ok (slowest the link into node 1, "), rule["message"]


def test_a_straggler_nodes_slow_transfers_are_its_cpus_not_its_links():
    summary = summarize_records(two_by_two(slow_node=1), links=links(0.002, 0.42, ranks_per_node=2))
    assert summary["rules"]["LoadBalancing"]["nodes"] == [1]
    rule = summary["rules"]["SlowLink"]
    assert (rule["triggered"], rule["nodes"]) == (False, [])
    assert rule["message"].startswith("none named: slowest the link into node 1, 2.5 MB/s; fastest 524.3 MB/s, but "
                                      "node 1 is a straggler (LoadBalancing)"), rule["message"]


def test_without_a_probe_there_is_no_link_rule_and_garbage_is_no_probe():
    assert "SlowLink" not in summarize_records(two_by_two(slow_node=None))["rules"]
    garbage = {0: probe(0, 1, 1e308), 1: probe(1, 1, 0.4), 2: {**probe(2, 0, 0.4), "link_bytes": True},
               3: {**probe(3, 2, 0.4), "node": -1}, 4: probe(4, 3, 0.0), 5: {**probe(5, 4, 0.4), "link_bytes": 1 << 40}}
    assert "SlowLink" not in summarize_records(two_by_two(slow_node=None), links=garbage)["rules"]
    one = summarize_records(two_by_two(slow_node=None), links={0: probe(0, 1, 0.4)})["rules"]["SlowLink"]
    assert not one["triggered"] and one["message"] == "no verdict: one node ran the link probe"


def test_ring_peers_are_the_same_local_rank_on_the_previous_and_next_node():
    where = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [_ring_peers(where, rank) for rank in range(6)] == [(4, 2), (5, 3), (0, 4), (1, 5), (2, 0), (3, 1)]
    assert _ring_peers([(0, 0), (0, 1)], 0) is None  # one node
    assert _ring_peers([(0, 0), (0, 1), (1, 0)], 0) is None  # unequal nodes
    assert _ring_peers([(-1, 0), (1, 0)], 0) is None  # a node unknown
    assert _ring_peers([(0, 0), (0, 0), (1, 0), (1, 1)], 0) is None  # two ranks claim one place


WORKER = """
import os, sys
import torch.distributed as dist
from dtrain.training.collectives import probe_links
from dtrain.training.metrics import MetricsWriter
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
link = probe_links("cpu", nbytes=1 << 16, repeats=3)
writer = MetricsWriter(rank, sys.argv[3])
writer.log(step=1, loss=0.0, samples=1, step_time_s=0.1, data_wait_s=0.0)
writer.log_link(link)
writer.close()
dist.destroy_process_group()
"""


def test_two_processes_probe_each_others_link_and_the_report_reads_it(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), port, str(tmp_path)],
                              env={**os.environ, "DTRAIN_NODE_INDEX": str(rank), "LOCAL_RANK": "0"})
             for rank in range(2)]
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    records = [json.loads(line) for line in (tmp_path / "rank1.jsonl").read_text().splitlines()]
    assert records[-1]["node"] == 1 and records[-1]["link_from_node"] == 0 and records[-1]["link_bytes"] == 1 << 16
    assert 0 < records[-1]["link_seconds"] < 60
    rule = summarize(str(tmp_path), skip_first=0)["rules"]["SlowLink"]
    assert [link["node"] for link in rule["links"]] == [0, 1] and not rule["triggered"]
