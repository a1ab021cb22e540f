"""The backend contract, and the registry that imports a backend on first use (fsspec style)."""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field

from operators.errors import DTrainError
from operators.launch.job import Job
from operators.launch.processes import LineSink, print_sink


@dataclass
class BackendOutcome:
    """How the job's node-level processes ended. ``exit_code`` 0 means every node succeeded."""

    exit_code: int
    node_index: int | None = None
    tail: list[str] = field(default_factory=list)
    stopped: bool = False


class Backend(abc.ABC):
    """Runs one prepared job to completion. ``terminate`` may be called from another thread
    or a signal handler, and must leave no process of the job alive anywhere."""

    name: str = "base"

    def __init__(self, sink: LineSink = print_sink):
        self.sink = sink

    @abc.abstractmethod
    def run(self, job: Job) -> BackendOutcome: ...

    @abc.abstractmethod
    def terminate(self) -> None: ...


# name -> (module path, class name, install hint). Imported only when asked for.
REGISTRY: dict[str, tuple[str, str, str]] = {
    "local": ("operators.launch.backends.local", "LocalBackend", "pip install 'airflow-dtrain[torch]'"),
    "slurm": ("operators.launch.backends.slurm", "SlurmBackend", "apt-get install slurm-client (sbatch, squeue, scontrol, scancel)"),
    "ssh": ("operators.launch.backends.ssh", "SSHBackend", "apt-get install openssh-client"),
    "mpi": ("operators.launch.backends.mpi_backend", "MPIBackend", "apt-get install openmpi-bin"),
}


def register_backend(name: str, module: str, cls: str, hint: str = "") -> None:
    REGISTRY[name] = (module, cls, hint)


def get_backend_class(name: str) -> type[Backend]:
    try:
        module_name, cls_name, hint = REGISTRY[name]
    except KeyError as e:
        raise DTrainError(f"backend={name!r} is unknown: one of {', '.join(sorted(REGISTRY))}") from e
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise DTrainError(f"backend {name!r} could not be imported ({e}); install it with: {hint}") from e
    return getattr(module, cls_name)
