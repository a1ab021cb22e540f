"""DistributedTrainingOperator in real Airflow (dag.test() on SQLite), and on_kill."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.launch.conftest import alive, script, wait_for


def run_dag(out_dir, nodes):
    from tests.conftest import load_test_dag

    dag = load_test_dag("launch_operator_dags.py", "launch_operator_test")
    return dag.test(run_conf={"nodes": nodes, "out_dir": out_dir})


def xcom_of(dag_run, task_id="train"):
    ti = next(t for t in dag_run.get_task_instances() if t.task_id == task_id)
    return ti.state, ti.xcom_pull(task_ids=task_id)


def test_operator_renders_params_launches_and_returns_xcom(airflow_db, out_dir):
    dag_run = run_dag(out_dir, 2)
    state, xcom = xcom_of(dag_run)
    assert state == "success"
    assert xcom["world_size"] == 4 and xcom["exit_code"] == 0 and xcom["duration_s"] > 0
    assert xcom["checkpoint_dir"].endswith(os.path.join("train", "checkpoints"))
    assert os.path.join("launch_operator_test", "") in xcom["run_dir"]  # keyed by dag, run and task
    assert len([n for n in os.listdir(out_dir) if n.startswith("rank")]) == 4


def test_operator_bad_param_fails_before_launch(airflow_db, out_dir):
    dag_run = run_dag(out_dir, "zero")
    state, _ = xcom_of(dag_run)
    assert state == "failed"
    assert os.listdir(out_dir) == []  # nothing was launched


def test_on_kill_tears_down_every_rank(tmp_path, out_dir):
    from dtrain.launch.airflow.operator import DistributedTrainingOperator

    op = DistributedTrainingOperator(task_id="t", command=[script("fail_rank.py")], nodes=2, procs_per_node=1,
                                     env={"OUT_DIR": out_dir}, run_dir=str(tmp_path / "run"))
    errors = []

    def execute():
        try:
            op.execute({"run_id": "r1"})
        except Exception as e:  # the stopped job raises LaunchError
            errors.append(e)

    thread = threading.Thread(target=execute)
    thread.start()
    wait_for(lambda: len([n for n in os.listdir(out_dir) if n.startswith("pid")]) == 2, timeout=120, what="ranks up")
    pids = op._launcher.backend.pids()
    assert len(pids) >= 4
    started = time.monotonic()
    op.on_kill()
    thread.join(timeout=60)
    assert not thread.is_alive() and time.monotonic() - started < 30
    assert alive(pids) == []
    assert errors and "stopped" in str(errors[0])


def test_operator_init_does_no_io_and_no_validation():
    from dtrain.launch.airflow.operator import DistributedTrainingOperator

    # Unrendered templates and even bad values are accepted at parse time; execute validates.
    op = DistributedTrainingOperator(task_id="t", command=["/does/not/exist.py"], nodes="{{ params.n }}")
    assert op.nodes == "{{ params.n }}"
    with pytest.raises(Exception, match="nodes=.{{ params.n }}. is invalid"):
        op.build_spec({"run_id": "x"})


@pytest.mark.parametrize("setting, expected", [(None, False), ("true", True), ("false", False)])
def test_deferrable_default_comes_from_airflow_config(setting, expected):
    """As the providers do: ``[operators] default_deferrable`` decides when the DAG does not."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE"}
    if setting is not None:
        env["AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE"] = setting
    code = ("from dtrain.launch.operator import DistributedTrainingOperator as Op; "
            "print(Op(task_id='t', command=['x']).deferrable, Op(task_id='u', command=['x'], deferrable=False).deferrable)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(expected), "False"]


def test_an_elastic_job_is_refused_deferrable_before_anything_starts(tmp_path):
    from dtrain.errors import SpecError
    from dtrain.launch.airflow.operator import DistributedTrainingOperator

    op = DistributedTrainingOperator(task_id="t", command=[script("fail_rank.py")], nodes="1:2", procs_per_node=1,
                                     run_dir=str(tmp_path / "run"), deferrable=True)
    with pytest.raises(SpecError) as e:
        op.execute({"run_id": "r1"})
    assert e.value.field == "deferrable" and "elastic" in str(e.value)
    assert not (tmp_path / "run").exists()


def test_a_failed_elastic_jobs_rounds_go_to_xcom_before_the_task_fails():
    """A job that ended below MIN has no result XCom: its rounds are pushed under dtrain_rounds (what
    the Training tab shows), then the task fails with the lost-node verdict."""
    from dtrain.errors import LaunchError
    from dtrain.launch.airflow.operator import DistributedTrainingOperator
    from dtrain.launch.core.job import ROUNDS_KEY
    from dtrain.launch.engine.launcher import LaunchResult

    class TI:
        def __init__(self):
            self.pushed = {}

        def xcom_push(self, key, value):
            self.pushed[key] = value

    rounds = [{"round": 0, "nodes": [0, 1, 2], "world_size": 3, "resume_step": 0}]
    lost = {"node": 1, "address": "10.0.0.2", "fault": "gone", "detail": "x", "message": "node 1 (10.0.0.2) lost"}
    op = DistributedTrainingOperator(task_id="t", command=["train.py"], nodes="2:3")
    failed, ti = LaunchResult.of_job("j", "/nonexistent", 3, 255, 1.0), TI()
    failed.rounds, failed.lost = rounds, lost
    with pytest.raises(LaunchError):
        op._raise_for_status(failed, {"ti": ti})
    assert ti.pushed == {ROUNDS_KEY: rounds}
    succeeded, ti = LaunchResult.of_job("j", "/nonexistent", 3, 0, 1.0), TI()
    succeeded.rounds = rounds
    op._raise_for_status(succeeded, {"ti": ti})
    assert ti.pushed == {}  # its result (return_value) has them
