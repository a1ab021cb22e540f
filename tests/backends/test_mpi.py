"""The backend contract on the mpi backend (mpirun starts every rank on this host)."""

from tests.backends.contract import BackendContract
from tests.remote.conftest import needs_mpirun


@needs_mpirun
class TestMPIBackend(BackendContract):
    backend = "mpi"
    nodes = 1

    def extra_spec(self) -> dict:
        return {"distribution": "mpi", "mpi_options": ["--oversubscribe"]}
