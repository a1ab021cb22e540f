"""Issue 23's "done means": a new user's own package, written outside the repository from the README
alone (tests/pipeline/readme_package.py: the README's factory example with only the names changed),
on a real scheduler (the production-shaped deployment of tests/deployment.py: PostgreSQL, Celery
workers on hosts of their own; the README starts `airflow standalone`, which the approval and MLflow tests run). Unpausing it gives a skipped run for its latest scheduled
date, which has no data, not a failed one; then the README's commands backfill three dates with
Airflow's default backfill concurrency, and each date warm-starts from, and is gated against, the
model published just before it."""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import time
from urllib.parse import quote

from .conftest import README_BUNDLE, REPO
from .readme_package import BUCKET, DAG_ID, DATES, write_package
from .test_retrain_e2e import backfill_create
from .test_tabular_e2e import decision

RUNS = {date: f"backfill__{date}T00:00:00+00:00" for date in DATES}


def readme_commands(readme: str) -> list[list[str]]:
    """The argv of each `airflow ...` line of the README's *Schedule and backfill* recipe."""
    section = readme[readme.index("### Schedule and backfill"):]
    block = section[section.index("```bash\n") + 8:section.index("```", section.index("```bash\n") + 8)]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("airflow ")]


def task_log(deployment, run_id: str, task_id: str) -> list[dict]:
    path = (f"/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}/logs/1"
            "?full_content=true")
    status, body = deployment.request("GET", path)
    assert status == 200, body
    return [item for item in body.get("content", []) if isinstance(item, dict)]


def rendered_init_from(deployment, run_id: str) -> str:
    """The {init_from} the train task's argv got (its rendered template, as the UI shows it)."""
    command = deployment.task_instance(DAG_ID, run_id, "train")["rendered_fields"]["command"]
    return command[command.index("--init-from") + 1]


def published_record(env: dict[str, str], date: str) -> dict | None:
    path = os.path.join(env["DTRAIN_SHARED_FS"], "models", DAG_ID, "v1", date, "metrics.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def wait_scheduled_run(deployment, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = deployment.request("GET", f"/dags/{DAG_ID}/dagRuns?run_type=scheduled")
        assert status == 200, body
        if body["dag_runs"] and body["dag_runs"][0]["state"] in ("success", "failed"):
            return body["dag_runs"][0]
        time.sleep(1)
    raise AssertionError(f"the scheduler did not finish a scheduled run of {DAG_ID} in {timeout}s")


def deploy(deployment, readme: str) -> None:
    """Write the package and its DAG file, and have Airflow parse it now (not at its next folder scan)."""
    write_package(deployment.env["README_USER"], readme, deployment.env["DTRAIN_SHARED_FS"])
    parsed = deployment.airflow("dags", "reserialize", "--bundle-name", README_BUNDLE)
    assert parsed.returncode == 0, parsed.stderr[-2000:]
    deployment.wait_ready(DAG_ID)


def test_a_new_users_package_from_the_readme_backfills_three_dates_in_order(deployment, capsys):
    started = time.monotonic()
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    deploy(deployment, readme)
    commands = readme_commands(readme)
    assert [c[:3] for c in commands] == [["airflow", "standalone"], ["airflow", "dags", "unpause"],
                                         ["airflow", "backfill", "create"]], commands
    unpause, backfill = commands[1], commands[2]
    assert unpause[3:] == ["tabular_retraining"], unpause  # the example's DAG id; this user's is DAG_ID
    assert deployment.airflow(*unpause[1:3], DAG_ID).returncode == 0  # already unpaused here (test settings)

    # Unpaused, the DAG got one scheduled run: its latest scheduled date, which has no data. Skipped, not red.
    scheduled = wait_scheduled_run(deployment)
    date = scheduled["logical_date"][:10]
    assert scheduled["state"] == "success", deployment.failure_report(DAG_ID, scheduled["dag_run_id"])
    assert date > DATES[-1] and scheduled["logical_date"] == scheduled["run_after"], scheduled
    reasons = [item.get("reason") for item in task_log(deployment, scheduled["dag_run_id"], "list_raw_inputs")
               if item.get("event") == "Skipping task."]
    assert reasons == [f"no raw data at s3://{BUCKET}/raw/v1/{date}/: nothing to train on for this partition: "
                       "this run is skipped (nothing trained or published). Upload the partition's files there "
                       "and clear this run to train it"], reasons
    for task_id in ("preprocess", "train", "publish"):
        assert deployment.task_instance(DAG_ID, scheduled["dag_run_id"], task_id)["state"] == "skipped"

    # The README's backfill, as written there (its DAG id is the example's): default concurrency.
    args = backfill[3:]
    named = args.index("--dag-id")
    assert args[named + 1] == "tabular_retraining", backfill
    del args[named:named + 2]  # backfill_create names this user's DAG
    assert "--max-active-runs" not in args and args[args.index("--from-date") + 1] == DATES[0] \
        and args[args.index("--to-date") + 1] == DATES[-1], backfill
    created = backfill_create(deployment, *args, dag_id=DAG_ID)
    assert created.returncode == 0, created.stdout[-2000:] + created.stderr[-2000:]
    runs = {}
    for date in DATES:
        runs[date] = deployment.wait_run(DAG_ID, RUNS[date], timeout=900)
        assert runs[date]["state"] == "success", deployment.failure_report(DAG_ID, RUNS[date])
    elapsed = time.monotonic() - started

    # Each date warm-started from, and was gated against, the newest model published before it ...
    env = deployment.env
    records = {d: published_record(env, d) for d in DATES}
    assert records[DATES[0]] is not None  # the first model has nothing to beat
    newest = None  # (model path, its f1) published before the date
    lines = []
    for date in DATES:
        init_from, gate = rendered_init_from(deployment, RUNS[date]), decision(deployment, DAG_ID, RUNS[date])
        assert init_from == (newest[0] if newest else ""), (date, init_from, newest)
        assert gate["baseline_model"] == (newest[0] if newest else None), (date, gate)
        assert gate["baseline"] == (newest[1] if newest else None), (date, gate)
        assert gate["publish"] == (records[date] is not None), (date, gate)
        lines.append(f"{date}: init_from={os.path.basename(os.path.dirname(init_from)) or '-'} "
                     f"f1={gate['value']} baseline={gate['baseline']} publish={gate['publish']}")
        if records[date] is not None:
            assert records[date]["training"]["warm_start_from"] == (newest[0] if newest else None)
            newest = (os.path.join(env["DTRAIN_SHARED_FS"], "models", DAG_ID, "v1", date, "model.pt"),
                      records[date]["evaluation"]["f1"])
    # ... though the three dates ran at once (the backfill's concurrency is 10): train waited, and said why.
    first_end = dt.datetime.fromisoformat(runs[DATES[0]]["end_date"])
    assert all(dt.datetime.fromisoformat(runs[d]["start_date"]) < first_end for d in DATES[1:]), runs
    waits = [item["event"] for item in task_log(deployment, RUNS[DATES[1]], "train")
             if str(item.get("event", "")).startswith("train waits for the run of")]
    assert waits and waits[0].startswith(f"train waits for the run of {DATES[0]} ({RUNS[DATES[0]]}), still running"), \
        waits
    with capsys.disabled():
        print(f"\n[e2e] README user package: unpause + backfill of 3 dates (1x2, default concurrency): "
              f"{elapsed:.1f} s; " + "; ".join(lines))
