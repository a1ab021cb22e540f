"""Ordered partitions and dates without data, below Airflow: when a date may train
(check_earlier_dates, exact messages), how the factory wires it (train's pre_execute), and the
"no raw data" error the first task turns into a skip. The
same with a real scheduler and backfill: test_readme_pipeline.py."""

from __future__ import annotations

import datetime as dt
import types

import pytest

from dtrain.errors import SpecError
from dtrain.pipeline.steps import (EarlierDateBlocking, EarlierDateRunning, NoRawData, check_earlier_dates,
                                   list_raw_inputs)

from .test_factory import build


def run(date: str, state: str, run_id: str | None = None):
    """What the SDK's ti.get_previous_dagrun() returns, reduced to what the check reads."""
    return types.SimpleNamespace(run_id=run_id or f"backfill__{date}T00:00:00+00:00", state=state,
                                 logical_date=dt.datetime.fromisoformat(f"{date}T00:00:00+00:00"))


def test_a_date_trains_when_no_earlier_run_is_running_and_the_previous_did_not_fail():
    check_earlier_dates(None, None, None)  # the first date
    check_earlier_dates(None, None, run("2026-02-01", "success"))


def test_a_date_waits_while_an_earlier_run_is_running_and_says_for_which():
    with pytest.raises(EarlierDateRunning) as err:
        check_earlier_dates(run("2026-02-01", "running"), None, run("2026-02-02", "success"))
    assert str(err.value) == (
        "train waits for the run of 2026-02-01 (backfill__2026-02-01T00:00:00+00:00), still running: each date "
        "trains after every earlier date has published its model or been gated out, so that it warm-starts from "
        "and is gated against the newest model before it (this date's data is already staged)")


def test_a_failed_previous_run_stops_the_date_with_how_to_go_on():
    with pytest.raises(EarlierDateBlocking) as err:
        check_earlier_dates(None, None, run("2026-02-02", "failed", "manual__x"))
    assert str(err.value) == (
        "the run of 2026-02-02 (manual__x) failed, so its model was neither published nor gated out, and this "
        "date would warm-start from and be gated against a model older than 2026-02-02. To go on: rerun "
        "2026-02-02 (clear its failed tasks), then clear this run's train task; or, to train without "
        "2026-02-02's model, mark the run of 2026-02-02 as success and clear this run's train task")


def test_an_earlier_run_that_has_not_started_stops_the_date_rather_than_hold_its_slot():
    with pytest.raises(EarlierDateBlocking) as err:
        check_earlier_dates(None, run("2026-02-01", "queued"), run("2026-02-01", "queued"))
    assert str(err.value).startswith("the run of 2026-02-01 (backfill__2026-02-01T00:00:00+00:00) has not started "
                                     "(queued), and a date trains only after every earlier date: this run fails "
                                     "rather than hold a run slot the earlier one may need.")


def test_the_train_task_checks_before_it_launches():
    train = build("ordered").get_task("train")
    assert train._pre_execute_hook.__name__ == "wait_for_earlier_dates"
    with pytest.raises(SpecError) as err:
        build(pre_execute=print)  # the factory's own hook cannot be replaced through operator_args
    assert err.value.field == "operator_args" and err.value.value == "pre_execute"
    for bad in (0, "30", True, 7200):
        with pytest.raises(SpecError) as err:
            build(earlier_dates_check_seconds=bad)
        assert str(err.value) == f"earlier_dates_check_seconds={bad!r} is invalid: a number of seconds from 1 to 3600"


def test_an_empty_partition_is_no_raw_data(tmp_path):
    (tmp_path / ".hidden").write_text("")
    with pytest.raises(NoRawData) as err:
        list_raw_inputs(f"{tmp_path}/", None)
    assert str(err.value) == f"no raw data at {tmp_path}/: nothing to train on for this partition"
    assert isinstance(err.value, FileNotFoundError)  # what callers caught before it had its own name
