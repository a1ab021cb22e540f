"""Helpers for the Slurm tests. The cluster itself (``slurm_cluster``, ``slurm``) is one of the
suite's daemons: tests/services.py."""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
DDP_REPORT = os.path.join(HERE, "scripts", "ddp_report.py")

from tests.slurm_cluster import queue  # noqa: E402,F401 (re-exported to the tests here)
from tests.support import alive, wait_for  # noqa: E402,F401 (re-exported to the tests here)


def cpu_spec(command, nodes=2, procs_per_node=2, **kwargs):
    """A LaunchSpec for the test cluster, on CPU. No GLOO_SOCKET_IFNAME: each node finds the interface
    that reaches the rendezvous host (node 1's first interface is a decoy)."""
    from dtrain.launch.core.spec import LaunchSpec

    return LaunchSpec(command=command, nodes=nodes, procs_per_node=procs_per_node, backend="slurm", device="cpu",
                      workdir=REPO, **kwargs)

