"""The backend contract on the slurm backend, against a real two-node Slurm cluster whose nodes are hosts
with their own addresses (tests/netcluster.py; node 1's first interface is a decoy)."""

import pytest

from tests.launch.backends.contract import BackendContract
from tests.launch.backends.slurm.conftest import queue


class TestSlurmBackend(BackendContract):
    backend = "slurm"

    @pytest.fixture
    def infra(self, slurm):  # noqa: F811
        yield slurm

    def options(self, infra) -> dict:
        return {"poll_interval": 0.3}

    def expected_ifname(self, infra, node_index: int) -> str:
        return infra.host(infra.nodes[node_index]).interface

    def assert_nothing_left(self, infra, job_id: str) -> None:
        super().assert_nothing_left(infra, job_id)
        from tests.support import poll_until

        assert poll_until(lambda: queue(infra) == [], 30), f"jobs still queued: {queue(infra)}"
        assert poll_until(lambda: infra.job_pids() == set(), 30), f"job processes left: {infra.job_pids()}"
