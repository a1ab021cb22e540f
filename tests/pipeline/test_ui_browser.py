"""The Training tab and the Retraining page in a real browser (Debian's headless chromium, driven by
selenium) inside the real Airflow UI of a production-shaped deployment (tests/deployment.py): a 2x2 DDP job watched live while it
trains, then its final page; a job that failed on one rank and one that hung; the Retraining page of
the example pipeline, whose backfill published one model and gated out the other.

Screenshots go to $DTRAIN_TEST_ARTIFACTS/ui (default test-artifacts/ui in the repository).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from urllib.parse import quote

import psutil
import pytest

from tests.support import kill_survivors, wait_for

from .conftest import REPO
from .test_retrain_e2e import backfill_create

ARTIFACTS = os.path.join(os.environ.get("DTRAIN_TEST_ARTIFACTS") or os.path.join(REPO, "test-artifacts"), "ui")
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
TABULAR = "tabular_retraining"
CURVES = ("loss", "samples_per_s", "data_wait_fraction")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless chromium; every process it started is stopped at the end, pass or fail. Its temp folder is
    the test's: chromium leaves its process-singleton directory (org.chromium.Chromium.*) there."""
    assert CHROMIUM and CHROMEDRIVER, "chromium and chromium-driver (Debian) are installed by scripts/bootstrap.sh"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1800", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    service = Service(CHROMEDRIVER, env={**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("chromium-tmp"))})
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(120)
    os.makedirs(ARTIFACTS, exist_ok=True)
    try:
        yield driver
    finally:
        tree = []
        try:
            root = psutil.Process(service.process.pid)
            tree = [root] + root.children(recursive=True)
        except (psutil.NoSuchProcess, AttributeError):
            pass
        try:
            driver.quit()
        finally:
            kill_survivors(tree, timeout=10)


def ui_url(deployment, path: str) -> str:
    return deployment.base_url + path


def training_tab(deployment, run_id: str, task_id: str = "train", dag_id: str = "ui_training") -> str:
    return ui_url(deployment, f"/dags/{dag_id}/runs/{quote(run_id, safe='')}/tasks/{task_id}/plugin/training")


def enter_plugin_frame(driver, page: str = "/dtrain/", timeout: float = 90) -> None:
    """Switch into the iframe the Airflow UI shows dtrain's ``page`` in (a client-side navigation
    replaces the iframe: wait for the one showing that page)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def frame():
        try:
            return next((f for f in driver.find_elements(By.CSS_SELECTOR, "iframe")
                         if page in (f.get_attribute("src") or "")), None)
        except StaleElementReferenceException:
            return None

    driver.switch_to.default_content()
    driver.switch_to.frame(wait_for(frame, timeout, what=f"the Airflow UI's iframe showing {page}"))


def js(driver, script: str):
    return driver.execute_script(script)


def page_state(driver) -> dict:
    return js(driver, """
        const q = (s) => document.querySelector(s);
        const series = {};
        for (const c of ["loss", "samples_per_s", "data_wait_fraction"]) {
          series[c] = [...document.querySelectorAll(`#plot-${c} svg g[id^="${c}-rank"]`)].map(g => g.id);
        }
        const path = q('#plot-loss svg g[id="loss-rank0"] path');
        return {
          state: q('#state') && q('#state').dataset.state,
          steps: q('#summary-list') ? Number(q('#summary-list').dataset.steps || -1) : -1,
          instance: document.body.dataset.pageInstance, refreshes: Number(document.body.dataset.refreshes || 0),
          series: series, loss_vertices: path ? (path.getAttribute('d').match(/L/g) || []).length + 1 : 0,
          tails: [...document.querySelectorAll('#tail-list .rank-tail')].map(d => d.dataset.rank),
          tail_text: [...document.querySelectorAll('#tail-list pre')].map(p => p.textContent).join('\\n'),
          tails_at_end: [...document.querySelectorAll('#tail-list pre')].every(
                          p => p.scrollHeight - p.scrollTop - p.clientHeight < 2),
          verdicts: Object.fromEntries([...document.querySelectorAll('#verdicts li')].map(
                      li => [li.dataset.rule, {triggered: li.dataset.triggered, text: li.textContent}])),
          checkpoints: [...document.querySelectorAll('#checkpoint-table tbody tr')].map(r => Number(r.dataset.step)),
          rounds: q('#rounds') && !q('#rounds').hidden ? [...document.querySelectorAll('#round-table tbody tr')].map(
                    r => [...r.querySelectorAll('td')].map(td => td.textContent)) : null,
          round_marks: [...document.querySelectorAll('#plot-loss svg g[id^="loss-round"]')].map(g => g.id),
          failure: q('#failure') && !q('#failure').hidden ? {rank: q('#failure').dataset.rank,
                   text: q('#failure-text').textContent, tail: q('#failure-tail').textContent} : null,
          hang: q('#hang') && !q('#hang').hidden ? {stuck: q('#hang').dataset.stuckRanks,
                text: q('#hang-text').textContent,
                links: [...document.querySelectorAll('#stack-links a.raw')].map(a => a.href),
                dumps: [...document.querySelectorAll('#stack-links details')].map(d => d.dataset.rank)} : null,
          live: q('#live') ? !q('#live').hidden : null,
          error: q('#error') && !q('#error').hidden ? q('#error').textContent : null,
        };""")


def wait_page(driver, predicate, timeout: float, what: str) -> dict:
    last = {}

    def check():
        nonlocal last
        last = page_state(driver)
        return last if predicate(last) else None

    try:
        return wait_for(check, timeout, interval=0.5, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}; the page showed: {json.dumps(last)[:3000]}") from None


def shot(driver, name: str) -> None:
    """A full-height screenshot of the page in the current frame's document."""
    height = js(driver, "return document.documentElement.scrollHeight") or 1800
    driver.switch_to.default_content()
    driver.set_window_size(1400, min(5000, max(1800, int(height) + 700)))
    driver.save_screenshot(os.path.join(ARTIFACTS, name))
    driver.set_window_size(1400, 1800)


def trigger_ui_run(deployment, run_id: str, **conf) -> None:
    deployment.trigger("ui_training", run_id, conf)


def wait_running(deployment, run_id: str, timeout: float = 180) -> None:
    wait_for(lambda: deployment.task_instance("ui_training", run_id, "train")["state"] == "running", timeout,
             interval=1, what=f"{run_id}: its training task to start")


def test_training_tab_grows_live_then_shows_every_rank_and_the_verdicts(deployment, browser, capsys):
    started = time.monotonic()
    run_id = "ui_live_2x2"
    # 2 nodes x 2 ranks, 60 steps; rank 3 waits 3x longer for each batch (CPUBottleneck), so every
    # rank runs at its pace through DDP's all-reduce: about 0.4 s a step.
    trigger_ui_run(deployment, run_id, nodes=2, procs_per_node=2,
                   args=["--steps", "60", "--sleep", "0.1", "--slow-data-rank", "3"])
    wait_running(deployment, run_id)
    browser.get(training_tab(deployment, run_id))
    enter_plugin_frame(browser)
    first = wait_page(browser, lambda s: s["state"] == "running" and s["steps"] >= 1 and s["loss_vertices"] >= 1,
                      120, "the Training tab showed no step of the running job")
    # Steps are drawn before the plots of the same refresh land: wait for the three to move on together.
    live = wait_page(browser, lambda s: s["steps"] >= first["steps"] + 5 and s["refreshes"] > first["refreshes"]
                     and s["loss_vertices"] > first["loss_vertices"], 90, "the live view did not grow")
    assert live["instance"] == first["instance"], "the page was reloaded (the live view must refresh in place)"
    assert live["refreshes"] > first["refreshes"] and live["loss_vertices"] > first["loss_vertices"]
    assert live["state"] == "running" and sorted(live["tails"]) == ["0", "1", "2", "3"]
    shot(browser, "training-tab-live.png")
    live_s = time.monotonic() - started

    run = deployment.wait_run("ui_training", run_id, timeout=300)
    assert run["state"] == "success", deployment.failure_report("ui_training", run_id)
    enter_plugin_frame(browser)
    final = wait_page(browser, lambda s: s["state"] == "succeeded" and s["steps"] == 60 and s["live"] is False, 60,
                      "the Training tab did not show the finished job")
    assert final["instance"] == first["instance"]
    for curve in CURVES:  # one series per rank on every plot
        assert sorted(final["series"][curve]) == [f"{curve}-rank{r}" for r in range(4)], final["series"]
    assert final["verdicts"]["CPUBottleneck"]["triggered"] == "true"
    assert "rank(s) 3" in final["verdicts"]["CPUBottleneck"]["text"]
    assert final["verdicts"]["LoadBalancing"]["triggered"] == "false"
    assert final["checkpoints"] == [50, 55, 60]  # every 5 steps, the last 3 kept
    assert "step 60 loss" in final["tail_text"] and final["tails_at_end"]  # the newest lines in view
    shot(browser, "training-tab.png")
    with capsys.disabled():
        print(f"\n[ui] 2x2 live Training tab: growing view seen {live_s:.1f} s after the trigger "
              f"(steps {first['steps']} -> {live['steps']}); whole test {time.monotonic() - started:.1f} s")


def test_a_failed_and_a_hung_job_show_the_rank_its_tail_and_the_stacks(deployment, browser):
    from selenium.webdriver.common.by import By

    trigger_ui_run(deployment, "ui_failed_2x2", nodes=2, procs_per_node=2,
                   args=["--steps", "30", "--fail-rank", "3", "--fail-step", "7"])
    # 40 s: a rank that has not reported yet counts as silent since the job started, and starting two
    # ranks under Airflow on a loaded 2-core machine has taken over 20 s (both were then judged stuck)
    trigger_ui_run(deployment, "ui_hung_1x2", nodes=1, procs_per_node=2, hang_timeout="40",
                   args=["--steps", "200", "--hang-rank", "1", "--hang-step", "4"])
    for run_id in ("ui_failed_2x2", "ui_hung_1x2"):
        assert deployment.wait_run("ui_training", run_id, timeout=300)["state"] == "failed"

    browser.get(training_tab(deployment, "ui_failed_2x2"))
    enter_plugin_frame(browser)
    failed = wait_page(browser, lambda s: s["state"] == "failed" and s["failure"] and s["refreshes"] >= 1, 60, "no failure shown")
    assert failed["failure"]["rank"] == "3" and "exit code 3" in failed["failure"]["text"]
    assert failed["failure"]["tail"].endswith("step 7: RuntimeError: rank 3 hit a bad batch")
    assert sorted(failed["series"]["loss"]) == [f"loss-rank{r}" for r in range(4)]
    assert failed["rounds"] is None and failed["round_marks"] == []  # no result: no rounds
    shot(browser, "training-tab-failed.png")

    # An elastic job's result names its rounds (dtrain.launch.core.elastic.Rounds): given the failed job
    # one through the REST API, its tab lists them and marks them on the plots.
    xcoms = f"/dags/ui_training/dagRuns/{quote('ui_failed_2x2', safe='')}/taskInstances/train/xcomEntries"
    rounds = [{"round": 0, "nodes": [0, 1], "world_size": 4, "resume_step": 0},
              {"round": 1, "nodes": [1], "world_size": 2, "resume_step": 5}]
    status, body = deployment.request("POST", xcoms, {"key": "return_value", "value": {
        "job_id": "elastic", "exit_code": 0, "duration_s": 1.0, "world_size": 4, "rounds": rounds}})
    assert status == 201, body
    try:
        browser.get(training_tab(deployment, "ui_failed_2x2"))
        enter_plugin_frame(browser)
        elastic = wait_page(browser, lambda s: s["rounds"] is not None and s["round_marks"], 60, "no rounds shown")
        assert elastic["rounds"] == [["0", "0, 1", "4", "0"], ["1", "1", "2", "5"]]
        assert sorted(elastic["round_marks"]) == ["loss-round-label0", "loss-round-label5", "loss-round0",
                                                  "loss-round1"]
        shot(browser, "training-tab-rounds.png")
    finally:
        deployment.request("DELETE", f"{xcoms}/return_value")

    browser.get(training_tab(deployment, "ui_hung_1x2"))
    enter_plugin_frame(browser)
    hung = wait_page(browser, lambda s: s["state"] == "hung" and s["hang"] and s["refreshes"] >= 1, 60, "no hang shown")
    assert hung["hang"]["stuck"] == "1" and "rank(s) 1 stuck" in hung["hang"]["text"]
    assert len(hung["hang"]["links"]) == 2 and all(re.search(r"/dtrain/api/ti/stack\?.*rank=[01]$", h)
                                                  for h in hung["hang"]["links"])
    assert hung["hang"]["dumps"] == ["0", "1"]
    # a person opens the stuck rank's stack dump: it unfolds in the page (no new window from the UI's iframe)
    browser.find_element(By.CSS_SELECTOR, '#stack-links details[data-rank="1"] summary').click()
    wait_for(lambda: "ui_train.py" in js(browser, "return document.querySelector("
                                                  "'#stack-links details[data-rank=\"1\"] pre').textContent"),
             30, what="rank 1's stack dump to unfold")
    shot(browser, "training-tab-hung.png")


@pytest.fixture(scope="module")
def gated_pipeline(deployment):
    """The example pipeline with one published and one gated-out run. tests/pipeline/test_tabular_e2e.py
    made them when it ran first in this session; run alone, this module makes them the same way."""
    status, data = deployment.request("GET", f"/dags/{TABULAR}/dagRuns?state=success&limit=100")
    assert status == 200, data
    have = {r["dag_run_id"] for r in data["dag_runs"]}
    runs = [f"backfill__{d}T00:00:00+00:00" for d in ("2026-03-02", "2026-03-03")]
    if not set(runs) <= have:
        out = backfill_create(deployment, "--from-date", "2026-03-02", "--to-date", "2026-03-03", "--dag-run-conf",
                              json.dumps({"epochs": 4}), "--max-active-runs", "1", dag_id=TABULAR)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        for run_id in runs:
            assert deployment.wait_run(TABULAR, run_id, timeout=900)["state"] == "success"
    return runs


def test_retraining_page_shows_published_and_gated_out_runs_linking_to_their_training_tabs(
        deployment, browser, gated_pipeline):
    from selenium.webdriver.common.by import By

    published, gated = gated_pipeline
    browser.get(ui_url(deployment, "/plugin/retraining"))
    enter_plugin_frame(browser)
    wait_for(lambda: js(browser, "return document.body.dataset.loaded === 'true' && "
                                 f"!!document.querySelector('section[data-dag-id=\"{TABULAR}\"] svg')"),
             60, what="the Retraining page to load the example pipeline")
    rows = js(browser, f"""return Object.fromEntries([...document.querySelectorAll(
        'section[data-dag-id="{TABULAR}"] tr[data-run-id]')].map(r => [r.dataset.runId,
        {{outcome: r.dataset.outcome, text: r.textContent,
          links: [...r.querySelectorAll('a.training-link')].map(a => a.getAttribute('href'))}}]))""")
    assert rows[published]["outcome"] == "published" and "2026-03-02" in rows[published]["text"]
    assert rows[gated]["outcome"] == "gated out" and "less than min_improvement 0" in rows[gated]["text"]
    series = js(browser, f"return [...document.querySelectorAll('section[data-dag-id=\"{TABULAR}\"] svg g[id]')]"
                         ".map(g => g.id)")
    assert f"{TABULAR}-published" in series and f"{TABULAR}-gated-out" in series
    assert rows[gated]["links"] == [f"/dags/{TABULAR}/runs/{quote(gated, safe='')}/tasks/train/plugin/training"]
    shot(browser, "retraining-page.png")

    enter_plugin_frame(browser)  # a person follows the gated-out run's link to its Training tab
    browser.find_element(By.CSS_SELECTOR, f'tr[data-run-id="{gated}"] a.training-link').click()
    wait_for(lambda: "/plugin/training" in browser.current_url, 30, what="the link to open the Training tab")
    assert browser.current_url == ui_url(deployment, rows[gated]["links"][0])
    enter_plugin_frame(browser, f"run_id={quote(gated, safe='')}")
    tab = wait_page(browser, lambda s: s["state"] == "succeeded" and s["steps"] > 0 and s["refreshes"] >= 1, 60,
                    "the gated-out run's Training tab did not load")
    assert sorted(tab["series"]["loss"]) == [f"loss-rank{r}" for r in range(len(tab["series"]["loss"]))]
