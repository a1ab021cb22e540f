"""An elastic job's rounds on the Training tab: from the training task's result XCom (``return_value["rounds"]``,
the launcher's dtrain.launch.core.elastic.Rounds), or for a job that failed its rounds XCom, validated (the XCom is anyone's who may edit the task
instance: a value that is not the launcher's is dropped, never shown), listed in the summary and marked on each
per-rank plot at the round's resume step; none while the job runs (it has no result yet)."""

from __future__ import annotations

import json

import pytest

from dtrain.launch.core.job import ROUNDS_KEY
from dtrain.ui import metrics_cache, plots, training
from tests.ui.client import get, rest, ti_query, xcom_entries

CURVES = ("loss", "samples_per_s", "data_wait_fraction")
#: 3 nodes x 1 proc: node 1 lost after step 8 (the survivors go on from step 5 as ranks 0 and 1), it comes
#: back and rejoins as rank 2 from step 10
ROUNDS = [{"round": 0, "nodes": [0, 1, 2], "world_size": 3, "resume_step": 0},
          {"round": 1, "nodes": [0, 2], "world_size": 2, "resume_step": 5},
          {"round": 2, "nodes": [0, 2, 1], "world_size": 3, "resume_step": 10}]


def good(n: int = 0, **changes) -> dict:
    return {"round": n, "nodes": [0, 1], "world_size": 2, "resume_step": 10 * n, **changes}


def nested(depth: int):
    value: object = [1]
    for _ in range(depth):
        value = {"x": [value]}
    return value


#: rounds values that are no launcher's; each with one good round (round 0): what the tab keeps of it
HOSTILE = {
    "a string": ("<script>alert(1)</script>", []),
    "a dict": ({"round": 0, "nodes": [0], "world_size": 1, "resume_step": 0}, []),
    "more rounds than the launcher keeps": ([good(n) for n in range(training.MAX_ROUNDS + 1)], []),
    "negative numbers": ([good(), good(1, resume_step=-5), good(2, round=-2), good(3, world_size=-2),
                          good(4, nodes=[-1, 0])], [good()]),
    "strings, floats, bools and nulls for ints": ([good(), good(1, round="1"), good(2, resume_step=20.0),
                                                  good(3, world_size=True), good(4, nodes=[0, None]),
                                                  good(5, resume_step="<img src=x onerror=alert(1)>")], [good()]),
    "numbers out of bounds": ([good(), good(1, resume_step=2**53), good(2, world_size=10**7),
                               good(3, round=10**12), good(4, nodes=[0, 10**6]), good(5, resume_step=10**400)],
                              [good()]),
    "nodes that are no list of distinct nodes": ([good(), good(1, nodes="0,1"), good(2, nodes=[]),
                                                 good(3, nodes=[1, 1]), good(4, nodes={"0": 1}),
                                                 good(5, nodes=list(range(training.MAX_ROUND_NODES + 1)),
                                                      world_size=training.MAX_ROUND_NODES + 1)], [good()]),
    "a world size that is no whole number of ranks per node": ([good(), good(1, world_size=3)], [good()]),
    "missing keys": ([good(), {"round": 1, "nodes": [0]}, {}], [good()]),
    "nested junk": ([good(), nested(50), [good(1)], good(2, nodes=[[0], [1]]), good(3, round={"a": [1, 2]}),
                     good(4, nodes=[0, nested(20)])], [good()]),
    "a repeated round number": ([good(), good(0, resume_step=99)], [good()]),
}


# -- pure: the validation and the plot ---------------------------------------------------------------

@pytest.mark.parametrize("case", list(HOSTILE))
def test_rounds_that_are_no_launchers_are_dropped(case):
    value, kept = HOSTILE[case]
    assert training.rounds_of({"exit_code": 0, "rounds": value}) == kept


def test_rounds_are_read_from_a_result_only_and_ordered_with_other_keys_left_out():
    for result in (None, "rounds", [ROUNDS], {"exit_code": 0}, {"rounds": None}):
        assert training.rounds_of(result) == []
    shuffled = [ROUNDS[2], dict(ROUNDS[0], hosts=["<b>a</b>"], extra=nested(5)), ROUNDS[1]]
    assert training.rounds_of({"rounds": shuffled}) == ROUNDS
    assert training.rounds_of({"rounds": [good(n) for n in range(training.MAX_ROUNDS)]})[-1] == good(999)
    marks = training.round_marks(training.rounds_of({"rounds": [good(n) for n in range(30)]}))
    assert len(marks) == training.MAX_MARKED_ROUNDS and marks[-1] == (29, 2, 290)  # the latest ones


def test_a_plot_marks_each_round_at_its_resume_step_labelled_with_its_world_size():
    by_rank = {"0": [[s, 1.0 / s] for s in range(1, 16)], "2": [[s, 1.0 / s] for s in range(1, 9)]}
    svg = plots.rank_curves("loss", "Loss", "loss", by_rank, training.round_marks(ROUNDS))
    for r in ROUNDS:
        assert f'id="loss-round{r["round"]}"' in svg
    assert 'id="loss-rank0"' in svg and 'id="loss-rank2"' in svg
    shared = plots.rank_curves("loss", "Loss", "loss", by_rank, ((0, 3, 0), (1, 2, 0)))
    assert 'id="loss-round0"' in shared and 'id="loss-round1"' in shared and 'id="loss-round-label0"' in shared
    assert 'id="loss-round' not in plots.rank_curves("loss", "Loss", "loss", by_rank)  # no rounds: no marker


# -- through the real API app ---------------------------------------------------------------------------

def step(n: int, loss: float, node: int) -> dict:
    return {"step": n, "loss": loss, "samples": 32, "step_time_s": 0.1, "data_wait_s": 0.02, "samples_per_s": 320.0,
            "epoch": 0, "node": node, "time": 1700000000.0 + n}


def write_elastic_metrics(run_dir) -> None:
    """What the ranks of :data:`ROUNDS` write: rank 2 (node 2, then node 1) stops at step 8 and starts
    again at step 10; ranks 0 and 1 go back to step 5 and climb again."""
    metrics = run_dir / "metrics"
    metrics.mkdir()
    files = {
        0: [step(n, 1.0 / n, 0) for n in range(1, 9)] + [step(n, 1.0 / n, 0) for n in range(5, 16)],
        1: [step(n, 1.0 / n, 1) for n in range(1, 9)] + [step(n, 1.0 / n, 2) for n in range(5, 10)]
           + [step(n, 1.0 / n, 2) for n in range(10, 16)],
        2: [step(n, 1.0 / n, 2) for n in range(1, 9)] + [step(n, 1.0 / n, 1) for n in range(10, 16)],
    }
    for rank, records in files.items():
        (metrics / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def xcom_setter(api, run, key: str):
    """``put(value)``: the run's training task's XCom ``key`` set to ``value`` through the REST API (as
    its operator, or anyone who may edit it, would); ``made``: whether it was made (to remove it)."""
    path = xcom_entries("ui_training", run.run_id, "train")
    made = []

    def put(value) -> None:
        if made:
            response = rest(api, "PATCH", f"{path}/{key}", {"value": value, "map_index": -1})
            assert response.status_code == 200, response.text
            return
        response = rest(api, "POST", path, {"key": key, "value": value})
        assert response.status_code == 201, response.text
        made.append(True)

    def remove() -> None:
        if made:
            rest(api, "DELETE", f"{path}/{key}")

    return put, remove


@pytest.fixture
def result_xcom(api, failed_run):
    """``put(value)``: the failed run's training task's ``return_value`` XCom set to ``value``; removed at
    the end, pass or fail."""
    put, remove = xcom_setter(api, failed_run, "return_value")
    try:
        yield put
    finally:
        remove()


@pytest.fixture
def rounds_xcom(api, failed_run):
    """``put(value)``: the failed run's training task's rounds XCom (what the operator pushes for an
    elastic job that failed) set to ``value``; removed at the end, pass or fail."""
    put, remove = xcom_setter(api, failed_run, ROUNDS_KEY)
    try:
        yield put
    finally:
        remove()


def summary(api, run) -> dict:
    response = get(api, "/dtrain/api/ti/summary", ti_query(run))
    assert response.status_code == 200, response.text[:300]
    return response.json()


def plot(api, run, curve: str = "loss") -> str:
    response = get(api, f"/dtrain/api/ti/plot/{curve}.svg", ti_query(run))
    assert response.status_code == 200 and response.text.startswith("<svg"), response.text[:300]
    return response.text


def result(rounds) -> dict:
    return {"job_id": "dtrain-elastic", "exit_code": 0, "duration_s": 12.5, "world_size": 3, "rounds": rounds}


def test_a_job_without_a_result_shows_no_rounds(api, failed_run, own_run_dir):
    write_elastic_metrics(own_run_dir)
    assert summary(api, failed_run)["rounds"] == []
    for curve in CURVES:
        assert 'id="%s-round' % curve not in plot(api, failed_run, curve)


def test_the_rounds_of_a_finished_elastic_job_are_listed_and_marked_on_every_plot(
        api, failed_run, own_run_dir, result_xcom):
    write_elastic_metrics(own_run_dir)
    before = plot(api, failed_run)  # watched while it ran: no result, no marker
    assert 'id="loss-round' not in before
    result_xcom(result(ROUNDS))
    view = summary(api, failed_run)
    assert view["rounds"] == ROUNDS and view["state"] == "succeeded"
    assert view["ranks_reporting"] == [0, 1, 2]
    for curve in CURVES:  # the plot drawn before the result is not reused
        svg = plot(api, failed_run, curve)
        assert all(f'id="{curve}-round{r["round"]}"' in svg for r in ROUNDS), curve
        assert all(f'id="{curve}-rank{r}"' in svg for r in range(3)), curve
    curves = get(api, "/dtrain/api/ti/curves", ti_query(failed_run)).json()["curves"]
    assert [p[0] for p in curves["loss"]["2"]] == list(range(1, 9)) + list(range(10, 16))  # a gap between rounds
    result_xcom(result(ROUNDS[:2]))  # the XCom edited: drawn again, and still one plot a curve kept
    svg = plot(api, failed_run)
    assert 'id="loss-round1"' in svg and 'id="loss-round2"' not in svg
    kept = metrics_cache.cached()[str(own_run_dir)]._computed
    assert [key for key in kept if key[0] == "plot"] == [("plot", c) for c in CURVES]


def test_the_rounds_of_an_elastic_job_that_failed_come_from_its_rounds_xcom(api, failed_run, own_run_dir,
                                                                          rounds_xcom):
    """A job that ended below MIN has no result; its operator pushes the rounds (dtrain_rounds): listed
    and marked as a result's would be, validated the same way."""
    write_elastic_metrics(own_run_dir)
    rounds_xcom(ROUNDS)
    assert summary(api, failed_run)["rounds"] == ROUNDS
    assert all(f'id="loss-round{r["round"]}"' in plot(api, failed_run) for r in ROUNDS)
    rounds_xcom([*ROUNDS, {"round": "<script>", "nodes": [0], "world_size": 1, "resume_step": 0}])
    assert summary(api, failed_run)["rounds"] == ROUNDS


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_rounds_in_the_result_xcom_are_dropped_not_rendered(api, failed_run, own_run_dir, result_xcom, case):
    write_elastic_metrics(own_run_dir)
    value, kept = HOSTILE[case]
    result_xcom(result(value))
    response = get(api, "/dtrain/api/ti/summary", ti_query(failed_run))
    assert response.status_code == 200, response.text[:300]
    assert response.json()["rounds"] == kept
    assert "<script>" not in response.text and "onerror" not in response.text
    svg = plot(api, failed_run)
    assert ('id="loss-round0"' in svg) is bool(kept)
    assert 'id="loss-round1"' not in svg and "onerror" not in svg and "&lt;script" not in svg
