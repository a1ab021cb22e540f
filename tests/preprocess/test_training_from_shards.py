"""Training from shards on launched ranks, and the data-stall report on real runs: a deliberately
slow loader trips CPUBottleneck, a deliberately slow rank trips LoadBalancing, each alone."""

from __future__ import annotations

import json
import os

from dtrain.stall_report import format_report, summarize

from .conftest import HERE, launch

STALL = os.path.join(HERE, "stall_train.py")


def test_reference_script_trains_from_shards_on_two_ranks(tmp_path, digits_shards):
    run = str(tmp_path / "run")
    launch(2, run, "-m", "dtrain.training.reference.train_digits", "--shards", digits_shards, "--epochs", "8")
    result = json.load(open(os.path.join(run, "metrics", "result.json"), encoding="utf-8"))
    assert result["world_size"] == 2 and result["test_accuracy"] >= 0.90, result
    assert result["steps"] == 8 * (1437 // 2 // 32)  # the shard sampler's equal per-rank share, whole batches
    summary = summarize(os.path.join(run, "metrics"))
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert all(r["steps"] == result["steps"] - 5 and r["samples_per_s"] > 0 for r in summary["ranks"])
    json.dumps(summary)  # XCom-able as is


def stall_run(tmp_path, *args: str) -> dict:
    run = str(tmp_path / "run")
    launch(2, run, STALL, "--steps", "40", *args)
    summary = summarize(os.path.join(run, "metrics"))
    print("\n".join(format_report(summary)))
    assert [r["steps"] for r in summary["ranks"]] == [35, 35]
    return summary


def test_report_flags_a_slow_loader_as_cpu_bottleneck(tmp_path, digits_shards):
    # 50 ms of loading per step against ~10 ms of compute on an idle core: data wait stays above half
    # also when the other test worker's job doubles the compute (20 ms let it fall to 38% under load)
    summary = stall_run(tmp_path, "--shards", digits_shards, "--load-sleep", "0.05")
    assert summary["flags"] == ["CPUBottleneck"]
    assert summary["rules"]["CPUBottleneck"]["ranks"] == [0, 1]
    assert all(r["data_wait_fraction"] > 0.5 for r in summary["ranks"])
    assert any(line.startswith("[stall] CPUBottleneck: TRIGGERED on ranks [0, 1]") for line in format_report(summary))


def test_report_flags_a_slow_rank_as_load_balancing(tmp_path, digits_shards):
    summary = stall_run(tmp_path, "--shards", digits_shards, "--slow-rank", "1", "--rank-sleep", "0.04")
    assert summary["flags"] == ["LoadBalancing"]
    rule = summary["rules"]["LoadBalancing"]
    assert rule["ranks"] == [1] and rule["slowest_to_median"] > 1.2
    assert any(line.startswith("[stall] LoadBalancing: TRIGGERED on rank 1") for line in format_report(summary))


def write_rank(directory, rank: int, steps: list[tuple[float, float]], samples: int = 32, extra: str = "") -> None:
    with open(os.path.join(directory, f"rank{rank}.jsonl"), "w", encoding="utf-8") as fh:
        for i, (step_time, wait) in enumerate(steps):
            fh.write(json.dumps({"step": i + 1, "epoch": 0, "loss": 1.0, "samples": samples,
                                 "step_time_s": step_time, "data_wait_s": wait}) + "\n")
        fh.write(extra)


def test_summary_figures_and_thresholds(tmp_path):
    write_rank(tmp_path, 0, [(9.0, 9.0)] * 5 + [(0.1, 0.02)] * 10)      # warm-up skipped; exactly 20%: not above
    write_rank(tmp_path, 1, [(0.1, 0.021)] * 10 + [(0.1, 0.021)] * 5, extra='{"step": 16, "step_ti')  # cut line
    write_rank(tmp_path, 2, [(0.12, 0.0)] * 15)                         # exactly 1.2x the median: not above
    summary = summarize(str(tmp_path))
    assert [r["steps"] for r in summary["ranks"]] == [10, 10, 10]
    r0 = summary["ranks"][0]
    assert r0["data_wait_fraction"] == 0.2 and r0["samples_per_s"] == 320.0 and r0["mean_step_time_s"] == 0.1
    assert summary["rules"]["CPUBottleneck"]["ranks"] == [1]
    assert summary["rules"]["LoadBalancing"]["triggered"] is False and summary["flags"] == ["CPUBottleneck"]
    write_rank(tmp_path, 2, [(0.121, 0.0)] * 15)
    assert summarize(str(tmp_path))["rules"]["LoadBalancing"]["ranks"] == [2]
    assert format_report(summarize(str(tmp_path / "none")))[0].startswith("[stall] no per-rank metrics")
