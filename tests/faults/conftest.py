"""Fault-injection tests, on the suite's real sshd "hosts" and two-node Slurm cluster
(tests/services.py), shared with tests/remote and tests/slurm."""

from tests.remote.conftest import needs_sshd  # noqa: F401 (used by the tests here)
from tests.slurm.conftest import cpu_spec, queue  # noqa: F401
