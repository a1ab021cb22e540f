"""DAGs for tests/deepspeed: DeepSpeedExamples-style scripts run unchanged through the operator, and
DeepSpeed's autotuner as a task whose optimal config the training task takes from XCom."""

from __future__ import annotations

import os

from airflow.sdk import DAG, Param

from dtrain.autotune.operator import DeepSpeedAutotuneOperator
from dtrain.launch.airflow.operator import DistributedTrainingOperator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "tests", "deepspeed", "scripts")
ZERO = os.path.join(SCRIPTS, "ds_zero_style.py")
PIPE = os.path.join(SCRIPTS, "ds_pipeline_style.py")
OUT = {"out": Param("/nonexistent", type="string")}
DS_ARGS = ["--deepspeed", "--deepspeed_config", "{deepspeed_config}", "--report-dir", "{run_dir}"]

with DAG(dag_id="deepspeed_scripts", schedule=None, catchup=False, params=OUT) as scripts_dag:
    zero = DistributedTrainingOperator(
        task_id="zero_2x2", nodes=2, procs_per_node=2, device="cpu", distribution="deepspeed", pass_local_rank=True,
        command=["python", ZERO, *DS_ARGS, "--steps", "2"], run_dir="{{ params.out }}/zero",
        deepspeed_config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                          "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "zero_allow_untested_optimizer": True,
                          "steps_per_print": 1000},
    )
    pipe = DistributedTrainingOperator(
        task_id="pipeline_1x2", nodes=1, procs_per_node=2, device="cpu", distribution="deepspeed",
        pass_local_rank=True, pipeline_parallel_size=2,
        command=["python", PIPE, *DS_ARGS, "--steps", "1"], run_dir="{{ params.out }}/pipeline",
        deepspeed_config={"train_batch_size": 256, "train_micro_batch_size_per_gpu": 8,
                          "gradient_accumulation_steps": 32, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
                          "steps_per_print": 1000},
    )
    zero >> pipe

with DAG(dag_id="deepspeed_autotune", schedule=None, catchup=False, params=OUT) as autotune_dag:
    autotune = DeepSpeedAutotuneOperator(
        task_id="autotune", command=["python", ZERO, "--deepspeed", "--deepspeed_config", "{deepspeed_config}",
                                     "--steps", "4"],
        # The smallest search (two experiments: DeepSpeed's profiling run and one micro batch size),
        # resumed: tests/deepspeed/test_autotune.py puts the CLI test's results of the same search in
        # the work directory, and without overwrite DeepSpeed skips the experiments that have one.
        # The training task has no config but the one it pulls from XCom.
        deepspeed_config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
                          "zero_allow_untested_optimizer": True, "steps_per_print": 1000,
                          "optimizer": {"type": "SGD", "params": {"lr": 0.01}}},
        autotuning={"start_profile_step": 1, "end_profile_step": 2, "min_train_micro_batch_size_per_gpu": 1,
                    "max_train_micro_batch_size_per_gpu": 1, "num_tuning_micro_batch_sizes": 1,
                    "tuner_num_trials": 1, "overwrite": False},
        procs_per_node=1, device="cpu", work_dir="{{ params.out }}/autotune",
    )
    train = DistributedTrainingOperator(
        task_id="train", procs_per_node=1, device="cpu", distribution="deepspeed",
        command=["python", ZERO, *DS_ARGS, "--steps", "2"], run_dir="{{ params.out }}/train",
        deepspeed_config="{{ ti.xcom_pull(task_ids='autotune')['optimal_config'] | tojson }}",
    )
    autotune >> train
