"""A DAG whose training task hangs (tests/launch/engine/faults/test_hang.py): rank 1 goes silent at step 4
while rank 0 blocks in all_reduce; hang_timeout arrives as a param, as a UI-triggered run sets it."""

from __future__ import annotations

import os

from airflow.sdk import DAG, Param

from dtrain.launch.airflow.operator import DistributedTrainingOperator

HANG_TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "scripts",
                          "hang_train.py")

with DAG(dag_id="hang_test", schedule=None, catchup=False,
         params={"hang_timeout": Param("8", type="string"), "run_dir": Param("/nonexistent", type="string")}) as dag:
    DistributedTrainingOperator(
        task_id="train",
        command=[HANG_TRAIN, "--silent-rank", "1", "--silent-step", "4"],
        procs_per_node=2,
        device="cpu",
        hang_timeout="{{ params.hang_timeout }}",
        run_dir="{{ params.run_dir }}",
        retries=0,
    )
