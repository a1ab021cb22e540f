"""DAGs for tests/launch/airflow/test_operator.py. Inputs arrive as params (dag.test(run_conf=...))."""

from __future__ import annotations

import os

from airflow.sdk import DAG, Param

from dtrain.launch.airflow.operator import DistributedTrainingOperator

DUMP_ENV = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "scripts", "dump_env.py")

with DAG(dag_id="launch_operator_test", schedule=None, catchup=False,
         params={"nodes": Param(2, type=["integer", "string"]), "out_dir": Param("/nonexistent", type="string")}) as dag:
    DistributedTrainingOperator(
        task_id="train",
        command=[DUMP_ENV, "{{ run_id }}"],
        nodes="{{ params.nodes }}",
        procs_per_node="2",
        env={"OUT_DIR": "{{ params.out_dir }}"},
    )
