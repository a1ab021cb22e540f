"""Fault-injection tests: the real sshd "hosts" (tests/remote) and the real two-node Slurm
cluster (tests/slurm), shared with those folders. Slurm tests: run them one session at a time
(``flock /tmp/dtrain-slurm-tests.lock pytest ...``)."""

from tests.remote.conftest import needs_sshd, ssh_cluster  # noqa: F401 (fixtures used by the tests here)
from tests.slurm.conftest import cpu_spec, queue, slurm, slurm_cluster  # noqa: F401
