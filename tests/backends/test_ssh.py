"""The backend contract on the ssh backend, against two real sshd hosts on loopback."""

import pytest

from tests.backends.contract import BackendContract
from tests.remote.conftest import needs_sshd


@needs_sshd
class TestSSHBackend(BackendContract):
    backend = "ssh"

    @pytest.fixture
    def infra(self, ssh_cluster):  # noqa: F811
        yield ssh_cluster

    def options(self, infra) -> dict:
        return {"hostfile": infra.hostfile(self.procs_per_node), **infra.ssh_settings()}
