"""The Training tab's test DAGs (tests/ui, tests/pipeline/test_ui_browser.py): ui_training, one airflow
training task whose job succeeds, fails on one rank, or hangs, as its params say; ui_own_root, a job
whose run directory lies under a root only the DAG's own code names."""

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

#: a runs root that no configuration names ([dtrain] runs_root, DTRAIN_SHARED_FS): only this DAG's code
#: declares it, in its training task's run_dir (dtrain.ui.provenance.declared_root), as the pipeline
#: factory's ``shared_fs`` does
OWN_RUNS_ROOT = os.path.join(os.path.dirname(os.environ.get("DTRAIN_HOME", "/tmp/dtrain")), "own-fsx", "runs")

with DAG(dag_id="ui_own_root", schedule=None, catchup=False, tags=["dtrain", "test"]) as own_root_dag:
    DistributedTrainingOperator(
        task_id="train",
        command=["python", UI_TRAIN, "--steps", "8"],
        nodes=1,
        procs_per_node=1,
        device="cpu",
        run_dir=os.path.join(OWN_RUNS_ROOT, "ui_own_root", "{{ run_id | replace(':', '_') | replace('+', '_') }}", "train"),
        hang_timeout=None,
        retries=0,
    )
