"""Demo: train an MLP on scikit-learn's digits with DDP on 2 simulated nodes x 2 processes.

Run it with ``bash scripts/demo.sh`` (or ``airflow dags test ddp_demo``). Trigger it
from the UI to change nodes, processes per node or epochs.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param, task

from dtrain.launch.operator import DistributedTrainingOperator

with DAG(
    dag_id="ddp_demo",
    schedule=None,
    catchup=False,
    tags=["dtrain", "demo"],
    params={
        "nodes": Param(2, type="integer", minimum=1, maximum=8, description="simulated nodes"),
        "procs_per_node": Param(2, type="integer", minimum=1, maximum=8, description="processes per node"),
        "epochs": Param(20, type="integer", minimum=1, maximum=200, description="training epochs"),
    },
) as dag:
    train = DistributedTrainingOperator(
        task_id="train",
        command=["python", "-m", "dtrain.training.reference.train_digits", "--epochs", "{{ params.epochs }}"],
        nodes="{{ params.nodes }}",
        procs_per_node="{{ params.procs_per_node }}",
    )

    @task
    def report(result: dict) -> float:
        accuracy = result["metrics"]["test_accuracy"]
        print(f"DEMO RESULT: test accuracy {accuracy:.4f} with world size {result['world_size']} "
              f"in {result['duration_s']:.1f}s; model and metrics in {result['run_dir']}")
        return accuracy

    report(train.output)
