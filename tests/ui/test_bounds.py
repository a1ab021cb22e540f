"""What a refresh of the Training tab costs when ranks write a lot, in Airflow's real app: a folder a
rank filled with files is read up to a bound and the tab says how much it left unread; a plot of
many ranks is their envelope, not a line each."""

from __future__ import annotations

import json
import re

from dtrain.rundir import MAX_LISTED
from tests.ui.client import get, ti_query

RANK_LINE = re.compile(r'id="loss-rank\d+"')


def write_steps(metrics, rank: int, steps: int, loss) -> None:
    metrics.mkdir(exist_ok=True)
    (metrics / f"rank{rank}.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": loss(rank, s), "samples": 32, "step_time_s": 0.1, "data_wait_s": 0.01,
                    "samples_per_s": 320.0}) + "\n" for s in range(1, steps + 1)))


def test_a_folder_filled_with_files_is_read_up_to_the_bound_and_the_rest_named(api, failed_run, own_run_dir):
    metrics = own_run_dir / "metrics"
    write_steps(metrics, 0, 3, lambda r, s: 1.0 / s)
    planted = MAX_LISTED + 500
    for i in range(planted):
        (metrics / f"planted{i}").touch()
    view = get(api, "/dtrain/api/ti/summary", ti_query(failed_run)).json()
    [unread] = view["unread"]
    assert (unread["folder"], unread["read"], unread["more"], unread["counted_all"]) == \
        ("metrics", MAX_LISTED, planted + 1 - MAX_LISTED, True)
    assert unread["message"] == f"metrics/ holds more entries than the tab reads: {MAX_LISTED} read, 501 more not read"


def test_past_twice_the_bound_the_rest_is_named_as_at_least_and_logs_say_so_too(api, failed_run, own_run_dir):
    for folder in ("metrics", "logs"):
        (own_run_dir / folder).mkdir()
        for i in range(3 * MAX_LISTED):
            (own_run_dir / folder / f"planted{i}").touch()
    [unread] = get(api, "/dtrain/api/ti/summary", ti_query(failed_run)).json()["unread"]
    assert (unread["folder"], unread["read"], unread["more"], unread["counted_all"]) == \
        ("metrics", MAX_LISTED, MAX_LISTED, False)
    assert unread["message"].endswith(f"{MAX_LISTED} read, at least {MAX_LISTED} more not read")
    logs = get(api, "/dtrain/api/ti/logs", ti_query(failed_run)).json()
    assert logs["tails"] == {} and [u["folder"] for u in logs["unread"]] == ["logs"]


def test_an_ordinary_run_directory_reads_whole(api, failed_run):
    assert get(api, "/dtrain/api/ti/summary", ti_query(failed_run)).json()["unread"] == []


def test_a_plot_of_many_ranks_is_their_envelope_not_a_line_each(api, failed_run, own_run_dir):
    ranks = 40
    for rank in range(ranks):
        write_steps(own_run_dir / "metrics", rank, 6, lambda r, s: r + 1.0 / s)
    response = get(api, "/dtrain/api/ti/plot/loss.svg", ti_query(failed_run))
    assert response.status_code == 200
    svg = response.text
    assert 'id="loss-ranks-range"' in svg and 'id="loss-ranks-median"' in svg
    assert not RANK_LINE.search(svg)
    assert f"lowest to highest of {ranks} ranks" in svg and "median rank" in svg


def test_up_to_16_ranks_are_a_line_each():
    from dtrain.ui.plots import MAX_RANK_LINES, rank_curves

    by_rank = {str(r): [[s, r + s] for s in range(1, 5)] for r in range(MAX_RANK_LINES)}
    svg = rank_curves("loss", "Loss", "loss", by_rank)
    assert len(RANK_LINE.findall(svg)) == MAX_RANK_LINES and "loss-ranks-range" not in svg


def test_the_envelope_is_the_lowest_median_and_highest_rank_at_each_step():
    from dtrain.ui.plots import envelope

    by_rank = {"0": [[1, 5.0], [2, 4.0]], "1": [[1, 1.0], [2, 2.0]], "2": [[1, 3.0], [2, 9.0]], "3": [[2, 0.5]]}
    assert envelope(by_rank) == [(1, 1.0, 3.0, 5.0), (2, 0.5, 3.0, 9.0)]


def test_steps_logged_apart_are_pooled_into_at_most_max_points_spans():
    from dtrain.ui.plots import envelope

    by_rank = {str(r): [[s * 7 + r, float(r)] for s in range(300)] for r in range(5)}  # 1500 distinct steps
    rows = envelope(by_rank, max_points=100)
    assert len(rows) == 100
    assert all(low == 0.0 and high == 4.0 for _, low, _, high in rows)
    assert [row[0] for row in rows] == sorted(row[0] for row in rows) and rows[-1][0] == 299 * 7 + 4
