"""The stable public path of the deferrable training task's trigger, ``dtrain.launch.trigger.DistributedJobTrigger``.

Airflow stores a deferred task's trigger by the classpath its ``serialize()`` returned, in its
metadata database, and the triggerer imports that path to run it again: tasks deferred before
the trigger moved to :mod:`dtrain.launch.airflow.trigger` (an upgrade while jobs run) are found
through this re-export. Nothing else belongs here.
"""

from dtrain.launch.airflow.trigger import DistributedJobTrigger

__all__ = ["DistributedJobTrigger"]
