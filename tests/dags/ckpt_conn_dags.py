"""DAG for tests/training/test_dcp_s3_connection.py: a 2-rank job checkpointing to s3:// with the
credentials of an Airflow AWS connection only (the backend comes from a param)."""

from __future__ import annotations

import os
import sys

from airflow.sdk import DAG, Param

from dtrain.launch.airflow.operator import DistributedTrainingOperator

DCP_JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "training", "scripts", "dcp_job.py")

with DAG(dag_id="ckpt_s3_connection", schedule=None, catchup=False,
         params={"dir": Param("s3://none/ckpt", type="string"), "out": Param("/nonexistent", type="string"),
                 "steps": Param(4, type="integer"), "run_dir": Param("/nonexistent", type="string"),
                 "backend": Param("local", type="string"), "ssh": Param({}, type="object"),
                 "slurm": Param({}, type="object")}) as dag:
    DistributedTrainingOperator(
        task_id="train", command=[sys.executable, DCP_JOB, "--dir", "{{ params.dir }}", "--out", "{{ params.out }}",
                                  "--steps", "{{ params.steps }}", "--every", "2"],
        nodes=2, procs_per_node=1, device="cpu", backend="{{ params.backend }}",
        backend_options={"ssh": "{{ params.ssh | tojson }}", "slurm": "{{ params.slurm | tojson }}"},
        run_dir="{{ params.run_dir }}", env={"OMP_NUM_THREADS": "1"}, aws_conn_id="dtrain_ckpt_s3", hang_timeout=None,
    )
