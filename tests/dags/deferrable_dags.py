"""DAGs for tests/launch/backends/slurm/remote/test_deferrable.py and test_ssh_deferrable.py: the training operator in
deferrable mode on Slurm and over SSH.

The SSH settings (key and known_hosts of the test sshd hosts) come from the environment the
test sets before loading this file (read at parse time, like a DAG author's constants).

The operator subclass records each event it resumes with (a real subclass, not a mock):
execute_complete only runs after the task deferred and the trigger fired.
"""

from __future__ import annotations

import json
import os

from airflow.sdk import DAG, Param

from dtrain.launch.airflow.operator import DistributedTrainingOperator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DDP_REPORT = os.path.join(REPO, "tests", "launch", "backends", "slurm", "scripts", "ddp_report.py")


class RecordingTrainingOperator(DistributedTrainingOperator):
    def execute_complete(self, context, event=None):
        with open(os.path.join(context["params"]["out_dir"], "events.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(event) + "\n")
        return super().execute_complete(context, event)


with DAG(dag_id="slurm_deferrable_test", schedule=None, catchup=False,
         params={"out_dir": Param("/nonexistent", type="string"), "fail_rank": Param(-1, type=["integer", "string"]),
                 "sleep": Param(0, type=["number", "string"])}) as dag:
    RecordingTrainingOperator(
        task_id="train",
        backend="slurm",
        deferrable=True,
        nodes=2,
        procs_per_node=1,
        device="cpu",
        # params.sleep keeps the job running (at most that long): until the test creates
        # OUT_DIR/release, once the test saw what it waits for.
        command=[DDP_REPORT, "{{ params.out_dir }}/rep", "--steps", "10", "--fail-rank", "{{ params.fail_rank }}",
                 "--sleep", "{{ params.sleep }}", "--until-file", "{{ params.out_dir }}/release"],
        workdir=REPO,
        backend_options={"slurm": {"poll_interval": 0.5}},
    )


with DAG(dag_id="ssh_deferrable_test", schedule=None, catchup=False,
         params={"out_dir": Param("/nonexistent", type="string"), "hostfile": Param("/nonexistent", type="string"),
                 "sleep": Param(0, type=["number", "string"])}) as ssh_dag:
    RecordingTrainingOperator(
        task_id="train",
        backend="ssh",
        deferrable=True,
        nodes=2,
        procs_per_node=1,
        device="cpu",
        # params.sleep: as the Slurm DAG's (tests/launch/airflow/faults/test_deployment_faults.py releases it)
        command=[DDP_REPORT, "{{ params.out_dir }}/rep", "--steps", "10", "--sleep", "{{ params.sleep }}",
                 "--until-file", "{{ params.out_dir }}/release"],
        backend_options={"ssh": {"hostfile": "{{ params.hostfile }}",
                                 "key_file": os.environ.get("DTRAIN_TEST_SSH_KEY", ""),
                                 "known_hosts_file": os.environ.get("DTRAIN_TEST_SSH_KNOWN_HOSTS", ""),
                                 "strict_host_key_checking": "yes"}},
        workdir=REPO,
    )
