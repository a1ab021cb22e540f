"""A real two-node Slurm cluster for the whole session (see cluster.py), and helpers.

Skipped only when not root (slurmd must run jobs as their user); missing Slurm
packages are an error, since CI installs them (scripts/apt-packages.txt).
"""

from __future__ import annotations

import os
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DDP_REPORT = os.path.join(HERE, "scripts", "ddp_report.py")

from tests.slurm.cluster import SlurmCluster, missing_binaries  # noqa: E402
from tests.support import alive, wait_for  # noqa: E402,F401 (re-exported to the tests here)


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        pytest.skip("the Slurm tests start slurmd, which must run as root to run jobs; run them as root")
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm/munge binaries missing: {missing}; install: apt-get install slurmctld slurmd slurm-client munge")
    cluster = SlurmCluster().start()
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = cluster.conf
    try:
        yield cluster
    finally:
        cluster.stop()
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        left = cluster.pids()
        assert not left, f"processes of the test cluster left after teardown: {sorted(left)}"


@pytest.fixture
def slurm(slurm_cluster):
    """The cluster, checked idle before and after each test (no job left behind)."""
    assert queue(slurm_cluster) == [], "a previous test left a job in the queue"
    yield slurm_cluster
    deadline = time.monotonic() + 30
    while queue(slurm_cluster) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert queue(slurm_cluster) == [], "the test left a job in the queue"


def queue(cluster) -> list[str]:
    """Job ids squeue still lists (any state, COMPLETING included)."""
    out = cluster.run(["squeue", "-h", "-o", "%i %T"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cpu_spec(command, nodes=2, procs_per_node=2, **kwargs):
    """A LaunchSpec for the test cluster: CPU, gloo over loopback (both nodes share this host)."""
    from dtrain.launch.spec import LaunchSpec

    env = {"GLOO_SOCKET_IFNAME": "lo", **kwargs.pop("env", {})}
    return LaunchSpec(command=command, nodes=nodes, procs_per_node=procs_per_node, backend="slurm", device="cpu",
                      workdir=REPO, env=env, **kwargs)


# The SSH backend's real sshd hosts (tests/remote), for deferrable mode over ssh.
from tests.remote.conftest import ssh_cluster  # noqa: E402,F401
