"""DAG for tests/launch/backends/ssh/remote/test_operator_ssh.py: preflight then launch over SSH, hosts from an Airflow connection."""

from __future__ import annotations

import os

from airflow.sdk import DAG, Param

from dtrain.launch.airflow.operator import DistributedTrainingOperator
from dtrain.preflight.operator import PreflightOperator

DUMP_ENV = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "scripts", "dump_env.py")

with DAG(dag_id="ssh_operator_test", schedule=None, catchup=False,
         params={"out_dir": Param("/nonexistent", type="string"), "hostile": Param("x", type="string")}) as dag:
    preflight = PreflightOperator(task_id="preflight", backend="ssh", nodes=2,
                                  backend_options={"ssh": {"conn_id": "dtrain_ssh_test"}},
                                  procs_per_node=2, device="cpu", checkpoint_dir="{{ params.out_dir }}",
                                  min_free_gb=0.001)
    train = DistributedTrainingOperator(
        task_id="train", backend="ssh", backend_options={"ssh": {"conn_id": "dtrain_ssh_test"}}, device="cpu",
        command=[DUMP_ENV, "{{ params.hostile }}"], nodes=2, procs_per_node=2,
        env={"OUT_DIR": "{{ params.out_dir }}"},
    )
    preflight >> train
