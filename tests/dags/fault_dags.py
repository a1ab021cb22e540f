"""DAGs for tests/launch/airflow/faults/test_reattach.py and test_retry_policy.py: a worker crash during a durable
(non-deferrable) training task on Slurm and over SSH, and the retry policy's verdicts.

The SSH settings (key and known_hosts of the test sshd hosts) come from the environment the test
sets before Airflow parses this file (read at parse time, like a DAG author's constants).
"""

from __future__ import annotations

import os
from datetime import timedelta

from airflow.sdk import DAG, Param

from dtrain.launch.airflow.operator import DistributedTrainingOperator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "tests", "launch", "airflow", "faults", "scripts", "resumable_train.py")
ONE_RETRY = {"retries": 1, "retry_delay": timedelta(seconds=1)}
TWO_RETRIES = {"retries": 2, "retry_delay": timedelta(seconds=1)}
COMMUNICATION_ERROR = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                       "Gloo connectFullMesh failed with Connection reset by peer")
SCRIPT_BUG = "ValueError: a bug in the training script"


def train_command() -> list[str]:
    # The job trains until the test creates OUT_DIR/release (once the retry has re-attached), or
    # for params.sleep seconds at most: no fixed worst-case sleep to wait out.
    return [TRAIN, "{{ params.out_dir }}", "--sleep", "{{ params.sleep }}",
            "--until-file", "{{ params.out_dir }}/release"]


# -- re-attach after a worker crash: real scheduler, the worker SIGKILLed mid-training --------------

with DAG(dag_id="fault_reattach_slurm", schedule=None, catchup=False, default_args=ONE_RETRY,
         params={"out_dir": Param("/nonexistent", type="string"),
                 "sleep": Param(0, type=["number", "string"])}) as slurm_dag:
    DistributedTrainingOperator(
        task_id="train", backend="slurm", nodes=2, procs_per_node=1, device="cpu", command=train_command(),
        workdir=REPO, backend_options={"slurm": {"poll_interval": 1.0}},
    )

# Three retries: tests/launch/airflow/faults/test_deployment_faults.py's rolling restart stops the worker of one try,
# then the worker its retry landed on (each retry re-attaches to the same job).
with DAG(dag_id="fault_reattach_ssh", schedule=None, catchup=False,
         default_args={"retries": 3, "retry_delay": timedelta(seconds=1)},
         params={"out_dir": Param("/nonexistent", type="string"), "sleep": Param(0, type=["number", "string"]),
                 "hostfile": Param("/nonexistent", type="string")}) as ssh_dag:
    DistributedTrainingOperator(
        task_id="train", backend="ssh", nodes=2, procs_per_node=1, device="cpu", command=train_command(),
        workdir=REPO,
        backend_options={"ssh": {"hostfile": "{{ params.hostfile }}",
                                 "key_file": os.environ.get("DTRAIN_TEST_SSH_KEY", ""),
                                 "known_hosts_file": os.environ.get("DTRAIN_TEST_SSH_KNOWN_HOSTS", ""),
                                 "strict_host_key_checking": "yes"}},
    )

# -- the retry policy: bad input fails at once, a communication error is retried --------------------

with DAG(dag_id="fault_bad_input", schedule=None, catchup=False, default_args=TWO_RETRIES,
         params={"out_dir": Param("/nonexistent", type="string"),
                 "nodes": Param("zero", type=["integer", "string"])}) as bad_input_dag:
    DistributedTrainingOperator(task_id="bad_nodes", nodes="{{ params.nodes }}", device="cpu",
                                command=[TRAIN, "{{ params.out_dir }}"])
    DistributedTrainingOperator(
        task_id="bad_deepspeed_config", distribution="deepspeed", nodes=1, procs_per_node=2, device="cpu",
        command=[TRAIN, "{{ params.out_dir }}"],
        # 3 is not micro batch 2 x accumulation 1 x 2 ranks: DeepSpeed would refuse it, so do we
        deepspeed_config={"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2,
                          "gradient_accumulation_steps": 1},
    )

with DAG(dag_id="fault_transient", schedule=None, catchup=False, default_args=TWO_RETRIES,
         params={"out_dir": Param("/nonexistent", type="string")}) as transient_dag:
    DistributedTrainingOperator(task_id="communication_error", device="cpu",
                                command=[TRAIN, "{{ params.out_dir }}/comm", "--fail-once", COMMUNICATION_ERROR])
    DistributedTrainingOperator(task_id="script_bug", device="cpu",
                                command=[TRAIN, "{{ params.out_dir }}/bug", "--fail-once", SCRIPT_BUG])
