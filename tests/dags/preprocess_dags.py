"""A DAG for tests/preprocess/test_preprocess_dag.py (test DAGs live in the tests/dags bundle): list the day's partitions, preprocess each in a
mapped task, then publish. Inputs arrive as params (dag.test(run_conf=...))."""

from __future__ import annotations

from airflow.sdk import DAG, Param, task

from dtrain.preprocess.operator import PreprocessFinalizeOperator, PreprocessOperator

with DAG(dag_id="preprocess_mapped_test", schedule=None, catchup=False,
         params={"raw": Param("/nonexistent", type="string"), "out": Param("/nonexistent", type="string")}) as dag:

    @task
    def list_partitions(raw: str) -> list[str]:
        import os

        return [os.path.join(raw, name) for name in sorted(os.listdir(raw)) if name.endswith(".jsonl")]

    parts = PreprocessOperator.partial(
        task_id="preprocess", transform="dtrain.preprocess.examples:digits_features",
        output_path="{{ params.out }}", workers="2", shard_size="200",
    ).expand(input=list_partitions("{{ params.raw }}"))
    PreprocessFinalizeOperator(task_id="publish", output_path="{{ params.out }}", partitions=parts.output)

# A DAG that tries to let its params choose the transform: transform is not a templated field, so
# "{{ params.t }}" is never rendered, and the task refuses it instead of running whatever t names.
TEMPLATED_PARAMS = {"t": Param("dtrain.preprocess.examples:digits_features", type="string"),
                    "raw": Param("/nonexistent", type="string"), "out": Param("/nonexistent", type="string")}
with DAG(dag_id="preprocess_templated_transform_test", schedule=None, catchup=False,
         params=TEMPLATED_PARAMS) as templated_dag:
    PreprocessOperator(task_id="preprocess", transform="{{ params.t }}", input="{{ params.raw }}",
                       output_path="{{ params.out }}", workers="1", retries=0)
