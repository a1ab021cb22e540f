"""The backend contract on the ssh backend, against three real sshd hosts with their own addresses
(tests/netcluster.py)."""

import pytest

from tests.launch.backends.contract import BackendContract
from tests.remote_jobs import needs_sshd


@needs_sshd
class TestSSHBackend(BackendContract):
    """The contract on hosts with their own addresses (network namespaces): 3 nodes, node 0 with a decoy
    interface listed before the one that reaches the others, and no GLOO_SOCKET_IFNAME from the user."""
    backend = "ssh"
    nodes = 3

    @pytest.fixture
    def infra(self, net_cluster):  # noqa: F811
        yield net_cluster

    def options(self, infra) -> dict:
        return {"hostfile": infra.hostfile(self.procs_per_node), **infra.ssh_settings()}

    def expected_ifname(self, infra, node_index: int) -> str:
        return infra.net.hosts[node_index].interface
