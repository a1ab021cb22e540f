"""The mpi backend: mpirun starts every rank (:mod:`.render` renders and checks its options)."""

from dtrain.launch.backends.mpi.backend import MPIBackend

__all__ = ["MPIBackend"]
