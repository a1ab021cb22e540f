"""The stable public import path of the training operator: what users' DAG files write (README.md,
docs/slurm.md)::

    from dtrain.launch.operator import DistributedTrainingOperator

The operator lives in :mod:`dtrain.launch.airflow.operator`; this module only re-exports it, so
that DAG files keep working wherever the code inside the package moves. Nothing else belongs here.
"""

from dtrain.launch.airflow.operator import DistributedTrainingOperator

__all__ = ["DistributedTrainingOperator"]
