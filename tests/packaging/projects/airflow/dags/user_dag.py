"""A user's DAG: its own ``operators`` package next to dtrain's operator."""

from airflow.sdk import DAG

from dtrain.launch.operator import DistributedTrainingOperator
from operators.custom import CustomThing

with DAG(dag_id="user_dag_with_own_operators", schedule=None, catchup=False,
         tags=["user", CustomThing.SOURCE]):
    DistributedTrainingOperator(task_id="train", command=["python", "train.py"], nodes=2, procs_per_node=2)
