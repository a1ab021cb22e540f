"""A deferred Slurm training task survives a crash of the triggerer that was polling it.

Real Airflow components run as separate processes (api-server, scheduler, dag-processor,
triggerer) on SQLite; the job runs on the real two-node Slurm cluster. While the job runs,
the triggerer is killed with SIGKILL; a new triggerer takes the orphaned trigger over
(rebuilt from its serialized kwargs: job id and run dir) and the task completes from the
same job: no resubmission, no second try.
"""

from __future__ import annotations

import json
import os
import time

from tests.airflow_services import AirflowServices, bundle

from .conftest import REPO, queue, wait_for

DAG = "slurm_deferrable_test"
# The job sleeps until the test releases it (creates OUT_DIR/release): after the crash, the
# takeover and a few polls by the new triggerer. This is only the most it sleeps if never released.
JOB_SECONDS = 300
# After the takeover the job runs on this long, watched by the new triggerer only: its trigger
# polls every 0.5 s (the DAG's poll_interval), and must not fire while the job still runs.
WATCHED_BY_THE_NEW_TRIGGERER_S = 5


def triggerer_of(ti: dict) -> int | None:
    """Id of the triggerer job running this task's trigger, or None."""
    return (ti.get("triggerer_job") or {}).get("id") or (ti.get("trigger") or {}).get("triggerer_id")


def test_deferred_task_survives_a_triggerer_crash(slurm, tmp_path):
    dags = os.path.join(REPO, "tests", "dags")
    env = dict(os.environ, AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC="1",
               AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD="5")
    services = AirflowServices(str(tmp_path / "home"), env, dags, [bundle("test-dags", dags)])
    out = tmp_path / "out"
    out.mkdir()
    try:
        services.migrate()
        for name in ("api-server", "scheduler", "dag-processor"):
            services.spawn(name, name)
        services.spawn("triggerer-1", "triggerer")
        services.wait_ready(DAG)
        services.trigger(DAG, "crash-1", {"out_dir": str(out), "sleep": JOB_SECONDS})

        def deferred_and_polled():
            ti = services.task_instance(DAG, "crash-1", "train")
            return ti["state"] == "deferred" and triggerer_of(ti) and queue(slurm) and ti

        ti = wait_for(deferred_and_polled, timeout=240, interval=1, what="the task deferred, its trigger running")
        first = triggerer_of(ti)
        [job_id] = queue(slurm)

        services.kill("triggerer-1")
        assert queue(slurm) == [job_id]  # a triggerer crash leaves the job alone
        services.spawn("triggerer-2", "triggerer")

        def taken_over():
            ti = services.task_instance(DAG, "crash-1", "train")
            return triggerer_of(ti) not in (None, first) and ti

        ti = wait_for(taken_over, timeout=120, interval=1, what="the new triggerer to take the trigger over")
        assert ti["state"] == "deferred" and queue(slurm) == [job_id]
        time.sleep(WATCHED_BY_THE_NEW_TRIGGERER_S)
        ti = services.task_instance(DAG, "crash-1", "train")
        assert ti["state"] == "deferred" and triggerer_of(ti) not in (None, first) and queue(slurm) == [job_id]
        assert not (out / "rep").exists()  # the job has not trained yet: it ends only once released
        (out / "release").touch()

        run = services.wait_run(DAG, "crash-1", timeout=300)
        assert run["state"] == "success", services.failure_report(DAG, "crash-1")
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        assert len(events) == 1 and events[0]["handle"]["backend_job_id"] == job_id and events[0]["status"] == "success"
        assert services.task_instance(DAG, "crash-1", "train")["try_number"] == 1  # resumed, not retried
        assert sorted(os.listdir(out / "rep")) == ["rank0.json", "rank1.json"]  # the job trained to the end
    finally:
        services.stop()
