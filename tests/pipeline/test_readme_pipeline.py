"""A new user's own package, written outside the repository from the README alone
(tests/pipeline/readme_package.py: the README's factory example with only the names changed, its
``shared_fs`` a folder of the team's own that is not the API server's DTRAIN_SHARED_FS, and MLflow as
its registry, given as the README's MLflow paragraph says), on a real scheduler (the production-shaped
deployment of tests/deployment.py: PostgreSQL, Celery workers on hosts of their own; the README starts
`airflow standalone`, which the approval and MLflow tests run) and a real `mlflow server` on the
deployment's bridge, connected as docs/own-pipeline.md says. Unpausing it gives a skipped run for its
latest scheduled date, which has no data, not a failed one; then the README's commands backfill three
dates with Airflow's default backfill concurrency, and each date warm-starts from, and is gated
against, the model published just before it. Then an old date is reprocessed: it starts from the
version published before its date (tag ``dtrain.partition``), not the newer champion; the Training tab
shows a run under the team's ``shared_fs``; and a consumer loads the ``@champion`` model in a fresh
venv holding nothing but what the version lists."""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from urllib.parse import quote, urlencode

import pytest

from .conftest import README_BUNDLE, REPO, example_module
from .readme_package import BUCKET, DAG_ID, DATES, MODEL, STEPS, write_package
from .test_retrain_e2e import backfill_create
from .test_tabular_e2e import decision

RUNS = {date: f"backfill__{date}T00:00:00+00:00" for date in DATES}
#: the date reprocessed after the backfill: an old date with a version before it and a newer champion
REPROCESSED = DATES[1]
CONSUMER = '''import importlib.util, json, sys
import mlflow.pytorch, torch
assert importlib.util.find_spec("moons_pipeline") is None and importlib.util.find_spec("dtrain") is None
model = mlflow.pytorch.load_model(sys.argv[1])
with torch.no_grad():
    logits = model(torch.tensor(json.loads(sys.argv[2])))
print(json.dumps({"class": type(model).__module__ + "." + type(model).__name__, "logits": logits.tolist()}))
'''


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


def wait_scheduled_run(deployment, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = deployment.request("GET", f"/dags/{DAG_ID}/dagRuns?run_type=scheduled")
        assert status == 200, body
        if body["dag_runs"] and body["dag_runs"][0]["state"] in ("success", "failed"):
            return body["dag_runs"][0]
        time.sleep(1)
    raise AssertionError(f"the scheduler did not finish a scheduled run of {DAG_ID} in {timeout}s")


def deploy(deployment, readme: str, shared_fs: str) -> None:
    """Write the package and its DAG file, and have Airflow parse it now (not at its next folder scan)."""
    write_package(deployment.env["README_USER"], readme, shared_fs)
    parsed = deployment.airflow("dags", "reserialize", "--bundle-name", README_BUNDLE)
    assert parsed.returncode == 0, parsed.stderr[-2000:]
    deployment.wait_ready(DAG_ID)


@pytest.fixture
def bridge_mlflow(deployment, tmp_path):
    """`mlflow server` on this machine's bridge address, where the workers' hosts reach it (as they reach
    PostgreSQL and S3), connected as docs/own-pipeline.md says. It starts in the background (its first
    start migrates its store): the test waits for it only before the backfill. Stopped at the end, and
    its connection removed (the deployment's later tests find none)."""
    from tests.mlflow.conftest import MlflowServer

    server = MlflowServer(str(tmp_path / "mlflow"), host=deployment.net.gateway)
    os.makedirs(server.root)
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(server.start)
        try:
            added = deployment.airflow("connections", "add", "mlflow_default", "--conn-uri", server.uri)
            assert added.returncode == 0, added.stderr[-2000:]
            yield server, started
        finally:
            wait([started])
            server.stop()
            removed, body = deployment.request("DELETE", "/connections/mlflow_default")
            assert removed == 204, body


def training_tab(deployment, run_id: str) -> tuple[int, dict]:
    """The Training tab's summary of the run's train task, from the deployment's API server."""
    query = urlencode({"dag_id": DAG_ID, "run_id": run_id, "task_id": "train", "map_index": -1})
    try:
        with urllib.request.urlopen(f"{deployment.base_url}/dtrain/api/ti/summary?{query}", timeout=90) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def published_versions(client) -> dict[str, list]:
    """partition -> its registered versions, oldest first."""
    found: dict[str, list] = {}
    for version in sorted(client.search_model_versions(f"name='{MODEL}'"), key=lambda v: int(v.version)):
        found.setdefault(version.tags["dtrain.partition"], []).append(version)
    return found


def warm_start_file(shared_fs: str, version) -> str:
    """Where MlflowRegistry downloads a version's trained file for {init_from}."""
    return os.path.join(shared_fs, "registry", DAG_ID, MODEL, str(version.version), "model.pt")


def f1_of(client, version) -> float:
    return client.get_run(version.run_id).data.metrics["eval.f1"]


def champion(client):
    return client.get_model_version_by_alias(MODEL, "champion")


def consumer_venv(tmp_path, uri: str) -> str:
    """A venv with only what the version's requirements.txt lists; returns its python."""
    import mlflow.pyfunc

    from tests.mlflow.fresh_venv import fresh_venv

    return fresh_venv(str(tmp_path / "consumer-venv"), mlflow.pyfunc.get_model_dependencies(uri))


@pytest.mark.timeout(1500)  # four pipeline runs and a venv on 2 shared cores
def test_a_new_users_package_from_the_readme_backfills_reprocesses_shows_and_serves(deployment, bridge_mlflow,
                                                                                      tmp_path, monkeypatch, capsys,
                                                                                      own_tmpdir):
    from mlflow import MlflowClient

    server, server_started = bridge_mlflow
    started = time.monotonic()
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    env = deployment.env
    shared_fs = os.path.join(env["README_USER"], "fsx")  # the team's own, as the README's "/fsx"
    assert os.path.commonpath([shared_fs, env["DTRAIN_SHARED_FS"]]) != env["DTRAIN_SHARED_FS"]
    os.makedirs(shared_fs)
    deploy(deployment, readme, shared_fs)
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
    server_started.result()  # the tracking server is up before any train task needs it
    client = MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)
    created = backfill_create(deployment, *args, dag_id=DAG_ID)
    assert created.returncode == 0, created.stdout[-2000:] + created.stderr[-2000:]
    runs = {}
    for date in DATES:
        runs[date] = deployment.wait_run(DAG_ID, RUNS[date], timeout=900)
        assert runs[date]["state"] == "success", deployment.failure_report(DAG_ID, RUNS[date])
    elapsed = time.monotonic() - started

    # Each date warm-started from, and was gated against, the newest version published before it ...
    published = published_versions(client)
    assert DATES[0] in published  # the first model has nothing to beat
    newest = None  # the version published before the date
    lines = []
    for date in DATES:
        init_from, gate = rendered_init_from(deployment, RUNS[date]), decision(deployment, DAG_ID, RUNS[date])
        assert init_from == (warm_start_file(shared_fs, newest) if newest else ""), (date, init_from, newest)
        assert gate["baseline_model"] == (f"models:/{MODEL}/{newest.version}" if newest else None), (date, gate)
        assert gate["baseline"] == (pytest.approx(f1_of(client, newest)) if newest else None), (date, gate)
        assert gate["publish"] == (date in published), (date, gate)
        lines.append(f"{date}: init_from={newest.version if newest else '-'} "
                     f"f1={gate['value']} baseline={gate['baseline']} publish={gate['publish']}")
        if date in published:
            (newest,) = published[date]
            assert f1_of(client, newest) == pytest.approx(gate["value"])
    # ... though the three dates ran at once (the backfill's concurrency is 10): train waited, and said why.
    first_end = dt.datetime.fromisoformat(runs[DATES[0]]["end_date"])
    assert all(dt.datetime.fromisoformat(runs[d]["start_date"]) < first_end for d in DATES[1:]), runs
    waits = [item["event"] for item in task_log(deployment, RUNS[DATES[1]], "train")
             if str(item.get("event", "")).startswith("train waits for the run of")]
    assert waits and waits[0].startswith(f"train waits for the run of {DATES[0]} ({RUNS[DATES[0]]}), still running"), \
        waits
    serving = champion(client)
    assert serving.version == newest.version, (serving, newest)

    # An old date reprocessed (its run cleared, as the UI's Clear does): it starts from, and is gated
    # against, the version published before its date, found by its partition tag, never the champion.
    (before,) = published[DATES[0]]
    assert serving.tags["dtrain.partition"] > REPROCESSED, \
        f"the champion must hold a later date than {REPROCESSED} for its reprocess to tell them apart: {lines}"
    uri = f"models:/{MODEL}@champion"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    reprocess_started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        venv = pool.submit(consumer_venv, tmp_path, uri)  # made while the reprocess runs
        status, cleared = deployment.request("POST", f"/dags/{DAG_ID}/dagRuns/{quote(RUNS[REPROCESSED], safe='')}"
                                                     "/clear", {"dry_run": False})
        assert status == 200, cleared

        # Meanwhile the Training tab: a run under the team's shared_fs, which is not the API server's
        # DTRAIN_SHARED_FS: shown, with both ranks (the root comes from the DAG's own code).
        status, view = training_tab(deployment, RUNS[DATES[-1]])
        assert status == 200, view
        assert view["job"]["run_dir"] == os.path.join(shared_fs, "runs", DAG_ID, "v1", DATES[-1], "run-0"), view["job"]
        assert view["state"] == "succeeded" and view["ranks_reporting"] == [0, 1] and view["steps"] == STEPS, view

        rerun = deployment.wait_run(DAG_ID, RUNS[REPROCESSED], timeout=900)
        assert rerun["state"] == "success", deployment.failure_report(DAG_ID, RUNS[REPROCESSED])
        reprocess_elapsed = time.monotonic() - reprocess_started
        init_from, gate = rendered_init_from(deployment, RUNS[REPROCESSED]), decision(deployment, DAG_ID,
                                                                                     RUNS[REPROCESSED])
        assert init_from == warm_start_file(shared_fs, before) != warm_start_file(shared_fs, serving), init_from
        assert gate["baseline_model"] == f"models:/{MODEL}/{before.version}", gate
        assert gate["baseline"] == pytest.approx(f1_of(client, before)), gate
        again = published_versions(client).get(REPROCESSED, [])[len(published.get(REPROCESSED, [])):]
        assert len(again) == int(gate["publish"]), (gate, again)
        if again:  # registered beside the champion, which serves a later date and stays
            assert client.get_model_version(MODEL, again[0].version).aliases == ["challenger"], again
        assert champion(client).version == serving.version
        status, view = training_tab(deployment, RUNS[REPROCESSED])  # the cleared run trained afresh
        assert status == 200 and view["job"]["run_dir"].endswith(f"/{REPROCESSED}/run-1"), (status, view)
        assert view["ranks_reporting"] == [0, 1] and view["steps"] == STEPS, view

        # A consumer elsewhere loads @champion in a venv holding only what the version lists.
        python = venv.result()
    x = [[0.1 * i - 0.5, 0.3 - 0.05 * i] for i in range(8)]
    home = tmp_path / "consumer"
    home.mkdir()
    proc = subprocess.run([python, "-c", CONSUMER, uri, json.dumps(x)], capture_output=True, text=True, timeout=300,
                          cwd=str(home), env={"PATH": os.environ["PATH"], "HOME": str(home),
                                              "MLFLOW_TRACKING_URI": server.uri, "TMPDIR": own_tmpdir})
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["class"] == "moons_pipeline.model.MoonsNet", loaded
    import torch

    trained = client.download_artifacts(serving.run_id, "trained/model.pt", str(tmp_path))
    with torch.no_grad():
        expected = example_module(env["README_USER"], "moons_pipeline.evaluate").load_model(trained)(torch.tensor(x))
    assert loaded["logits"] == [pytest.approx(row, abs=1e-5) for row in expected.tolist()]
    with capsys.disabled():
        print(f"\n[e2e] README user package with MLflow: unpause + backfill of 3 dates (1x2, default concurrency): "
              f"{elapsed:.1f} s; reprocess of {REPROCESSED}: {reprocess_elapsed:.1f} s; " + "; ".join(lines))
