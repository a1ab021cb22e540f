"""The Slurm backend: one sbatch job, ``srun`` starts one torchrun agent per node.

:mod:`.render` is the pure part (options, the sbatch script, reading Slurm's answers),
:mod:`.backend` talks to Slurm, :mod:`.cli` adds the ``dtrain launch`` options.
"""

from dtrain.launch.backends.slurm.backend import SlurmBackend
from dtrain.launch.backends.slurm.render import SlurmOptions

__all__ = ["SlurmBackend", "SlurmOptions"]
