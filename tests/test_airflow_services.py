"""The Airflow test harness itself: what a test waits for must be found wherever Airflow wrote it."""

from __future__ import annotations

import os
import time

from tests.airflow_services import AirflowServices
from tests.pipeline.test_tabular_e2e import REVIEWED, wait_until_parked

PARKED = ("2026-12-03T17:41:45Z [info] Received executor event with state success for task instance TaskInstanceKey("
          f"dag_id='{REVIEWED}', task_id='approve', run_id='review_2026-03-10', try_number=1, map_index=-1)\n")


def services(tmp_path) -> AirflowServices:
    home = tmp_path / "home"
    os.makedirs(home)
    (home / "standalone.log").write_text("scheduler  | the standalone's scheduler died here\n")
    return AirflowServices(str(home), {}, str(tmp_path / "dags"))


def test_a_line_from_the_revived_scheduler_is_found(tmp_path):
    # CI (stops 39, 40): standalone's scheduler died in an earlier test, the revived one logged the
    # approve task parking to scheduler.log, and the test read only standalone.log for 600 s.
    airflow = services(tmp_path)
    (tmp_path / "home" / "scheduler.log").write_text(PARKED)
    wait_until_parked(airflow, "review_2026-03-10", deadline=time.monotonic() + 5)
    assert "the standalone's scheduler died here" in airflow.scheduler_log()


def test_a_line_no_scheduler_wrote_is_not_found(tmp_path):
    airflow = services(tmp_path)
    (tmp_path / "home" / "scheduler.log").write_text(PARKED.replace("review_2026-03-10", "review_2026-03-11"))
    try:
        wait_until_parked(airflow, "review_2026-03-10", deadline=time.monotonic() + 1.5)
    except AssertionError as e:
        assert "the scheduler never saw approve park" in str(e)
    else:
        raise AssertionError("wait_until_parked found a line for another run")
