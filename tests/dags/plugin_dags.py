"""DAG for tests/pipeline/test_plugin.py: the plugin's macros rendered in a real task."""

from __future__ import annotations

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG


def _echo(lr: str, batch: str) -> dict:
    return {"lr": lr, "batch": batch}


with DAG(dag_id="plugin_macros_test", schedule=None, catchup=False, params={"nodes": 2}) as dag:
    PythonOperator(
        task_id="render",
        python_callable=_echo,
        op_kwargs={"lr": "{{ macros.dtrain.scaled_lr(0.1, 256, 32) }}",
                   "batch": "{{ macros.dtrain.global_batch_size(32, params.nodes, 4) }}"},
    )
