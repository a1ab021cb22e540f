"""The Training tab's test DAG (tests/ui, tests/pipeline/test_ui_browser.py): one airflow training task
whose job succeeds, fails on one rank, or hangs, as its params say."""

from __future__ import annotations

import os

from airflow.sdk import DAG, Param

from dtrain.launch.airflow.operator import DistributedTrainingOperator

UI_TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "ui_train.py")

with DAG(dag_id="ui_training", schedule=None, catchup=False, tags=["dtrain", "test"],
         params={"nodes": Param(2, type="integer"), "procs_per_node": Param(2, type="integer"),
                 "args": Param([], type="array"), "hang_timeout": Param("600", type="string")}) as dag:
    DistributedTrainingOperator(
        task_id="train",
        command="{{ (['python', '" + UI_TRAIN + "'] + params.args) | tojson }}",
        nodes="{{ params.nodes }}",
        procs_per_node="{{ params.procs_per_node }}",
        device="cpu",
        hang_timeout="{{ params.hang_timeout }}",
        retries=0,
    )
