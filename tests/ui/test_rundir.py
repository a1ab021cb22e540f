"""Reading a run directory as untrusted input, the per-rank log files, the curves and the Retraining rows:
the pure parts of the Training tab, on files made the way a job (or an attacker sharing its directory)
makes them."""

from __future__ import annotations

import json
import os

import pytest

from dtrain.launch.node.ranklog import RankLog
from dtrain.ui import external_views, training_tab_url
from dtrain.ui.retraining import pipeline_view
from dtrain.rundir import RunDir, UnsafeRunDir
from dtrain.curves import curves


def write_metrics(run_dir, rank: int, records) -> None:
    os.makedirs(run_dir / "metrics", exist_ok=True)
    with open(run_dir / "metrics" / f"rank{rank}.jsonl", "w") as fh:
        for record in records:
            fh.write((record if isinstance(record, str) else json.dumps(record)) + "\n")


def step(n: int, loss: float = 1.0, **extra) -> dict:
    return {"step": n, "loss": loss, "samples": 32, "step_time_s": 0.1, "data_wait_s": 0.02, "samples_per_s": 320.0,
            **extra}


@pytest.mark.parametrize("path", ["relative/run", "/runs/../etc", "/runs/./x", "/runs/x/", "", None, "/a\0b"])
def test_a_recorded_run_dir_must_be_absolute_and_normalized(path):
    with pytest.raises(UnsafeRunDir):
        RunDir(path)


def test_metrics_skip_cut_lines_and_foreign_records_and_ignore_other_names(tmp_path):
    write_metrics(tmp_path, 0, [step(1), '{"step": 2, "loss": 0.9', step(3), '"a string"', {"step": "4"}, step(5)])
    write_metrics(tmp_path, 1, [step(1)])
    (tmp_path / "metrics" / "rank2.jsonl.tmp").write_text(json.dumps(step(1)) + "\n")
    (tmp_path / "metrics" / "result.json").write_text("{}")
    metrics = RunDir(str(tmp_path)).metrics()
    assert sorted(metrics) == [0, 1]
    assert [r["step"] for r in metrics[0]] == [1, 3, 5]


def test_a_huge_metrics_file_is_read_from_its_end_only(tmp_path, monkeypatch):
    import dtrain.rundir as rundir

    monkeypatch.setattr(rundir, "MAX_METRICS_BYTES", 4096)
    write_metrics(tmp_path, 0, [step(n) for n in range(1, 1001)])
    records = RunDir(str(tmp_path)).metrics()[0]
    assert records[-1]["step"] == 1000 and 0 < len(records) < 60  # the newest steps; no cut first line
    assert [r["step"] for r in records] == list(range(records[0]["step"], 1001))


def test_curves_take_the_newest_record_of_a_step_repeated_after_a_restart_and_thin_long_runs(tmp_path):
    write_metrics(tmp_path, 0, [step(1, 5.0), step(2, 4.0), step(3, 3.0), step(2, 2.5), step(3, 2.0), step(4, 1.0)])
    out = curves(RunDir(str(tmp_path)).metrics())
    assert out["loss"]["0"] == [[1, 5.0], [2, 2.5], [3, 2.0], [4, 1.0]]
    assert out["data_wait_fraction"]["0"][0] == [1, 0.2]
    write_metrics(tmp_path, 1, [step(n, float(n)) for n in range(1, 5001)])
    thinned = curves(RunDir(str(tmp_path)).metrics(), max_points=100)["loss"]["1"]
    assert len(thinned) == 100 and thinned[0] == [1, 1.0] and thinned[-1] == [5000, 5000.0]
    nan = curves({0: [step(1, float("nan")), step(2, 0.5)]})
    assert nan["loss"]["0"] == [[2, 0.5]]  # NaN is no point (JSON cannot carry it)


def test_log_tails_stop_at_the_bound_and_skip_symlinks(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("".join(f"line {i}\n" for i in range(100_000)))
    secret = tmp_path / "secret"
    secret.write_text("SECRET\n")
    os.symlink(secret, logs / "rank1.log")
    tails = RunDir(str(tmp_path)).log_tails(3)
    assert tails == {0: ["line 99997", "line 99998", "line 99999"]}


def test_a_symlinked_subdirectory_is_not_entered(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_metrics(elsewhere, 0, [step(1)])
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(elsewhere / "metrics", run / "metrics")
    assert RunDir(str(run)).metrics() == {}
    assert RunDir(str(run)).read("metrics", "rank0.jsonl", limit=1 << 20) is None


def test_checkpoints_list_torch_files_and_deepspeed_tags_by_step(tmp_path):
    ckpt = tmp_path / "checkpoints"
    (ckpt / "deepspeed" / "step-00000020").mkdir(parents=True)
    (ckpt / "deepspeed" / "step-00000020" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 300)
    (ckpt / "step-00000010.pt").write_bytes(b"x" * 100)
    (ckpt / ".step-00000030.pt.123.tmp").write_bytes(b"x")
    (ckpt / "latest").write_text("step-00000010.pt\n")
    found = RunDir(str(tmp_path)).checkpoints()
    assert [(c["step"], c["name"], c["size_bytes"], c["kind"]) for c in found] == [
        (10, "step-00000010.pt", 100, "torch"), (20, "deepspeed/step-00000020", 300, "deepspeed")]


def test_a_rank_log_appends_with_a_header_and_rotates_at_its_bound(tmp_path):
    log = RankLog(str(tmp_path), 3, header="rank 3 started", max_bytes=4096)
    for i in range(600):  # about 5 KB: one rotation
        log.write(f"step {i}\n".encode())
    log.close()
    current = (tmp_path / "logs" / "rank3.log").read_text()
    previous = (tmp_path / "logs" / "rank3.log.1").read_text()
    assert previous.startswith("# ") and "rank 3 started" in previous.splitlines()[0]
    assert current.endswith("step 599\n") and len(current) <= 4096 and len(previous) <= 4096
    assert RunDir(str(tmp_path)).log_tails(2) == {3: ["step 598", "step 599"]}


def test_a_rank_log_never_writes_through_a_planted_symlink(tmp_path):
    (tmp_path / "logs").mkdir()
    target = tmp_path / "victim"
    target.write_text("intact\n")
    os.symlink(target, tmp_path / "logs" / "rank0.log")
    log = RankLog(str(tmp_path), 0, header="started")
    log.write(b"step 1\n")  # refused quietly: the rank keeps running, its lines still reach the task log
    log.close()
    assert target.read_text() == "intact\n"


def test_the_ui_links_carry_airflow_placeholders_and_quote_ids():
    views = {v["name"]: v for v in external_views("/airflow")}
    assert views["Training"]["href"] == ("/airflow/dtrain/ti?dag_id={DAG_ID}&run_id={RUN_ID}&task_id={TASK_ID}"
                                         "&map_index={MAP_INDEX}")
    assert views["Retraining"]["href"] == "/airflow/dtrain/retraining"
    assert training_tab_url("d", "manual__2026-01-01T00:00:00+00:00", "train", -1, base="") == (
        "/dags/d/runs/manual__2026-01-01T00%3A00%3A00%2B00%3A00/tasks/train/plugin/training")
    assert training_tab_url("d", "r", "train", 2, base="/af").endswith("/tasks/train/mapped/2/plugin/training")


def test_retraining_rows_tell_published_gated_out_and_unfinished_runs_apart():
    decision = {"metric": "rmse", "goal": "minimize", "publish": True, "value": 0.3, "baseline": None,
                "reasons": ["rmse 0.3 <= threshold 2"]}
    runs = [
        {"run_id": "r4", "state": "running", "partition": "2026-03-04", "training_tasks": []},
        {"run_id": "r3", "state": "success", "partition": "2026-03-03",
         "decision": {**decision, "publish": False, "value": 0.5, "baseline": 0.25, "reasons": ["worse"]},
         "training_tasks": [{"task_id": "train", "map_index": -1}]},
        {"run_id": "r2", "state": "success", "partition": "2026-03-02", "decision": decision,
         "published": {"metrics_path": "/models/m/v1/2026-03-02/metrics.json", "model_path": "/models/m.pt"}},
        {"run_id": "r1", "state": "failed", "partition": "2026-03-01"},
    ]
    view = pipeline_view("p", runs, lambda path, partition: {"evaluation": {"rmse": 0.25}, "approval": None}
                         if path.endswith(f"{partition}/metrics.json") and partition == "2026-03-02" else None)
    outcomes = {r["run_id"]: (r["outcome"], r["value"]) for r in view["runs"]}
    assert outcomes == {"r4": ("running", None), "r3": ("gated out", 0.5), "r2": ("published", 0.25),
                        "r1": ("failed before the gate", None)}
    assert view["points"] == [{"partition": "2026-03-03", "value": 0.5, "published": False, "run_id": "r3"},
                              {"partition": "2026-03-02", "value": 0.25, "published": True, "run_id": "r2"}]
    assert (view["metric"], view["published"], view["gated_out"]) == ("rmse", 1, 1)


def test_the_published_metrics_are_read_only_from_a_metrics_json_file_itself(tmp_path, monkeypatch):
    from dtrain.ui.app import read_published

    monkeypatch.setenv("AIRFLOW__DTRAIN__MODELS_ROOT", str(tmp_path / "models"))
    model = tmp_path / "models" / "p" / "v1" / "2026-03-02"
    model.mkdir(parents=True)
    record = {"pipeline": "p", "dataset_version": "v1", "partition": "2026-03-02", "evaluation": {"rmse": 0.25}}
    (model / "metrics.json").write_text(json.dumps(record))
    assert read_published("p", str(model / "metrics.json"), "2026-03-02") == record
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({**record, "partition": "2026-03-03", "SECRET": 1}))
    linked = tmp_path / "models" / "p" / "v1" / "2026-03-03"
    linked.mkdir()
    os.symlink(secret, linked / "metrics.json")
    assert read_published("p", str(linked / "metrics.json"), "2026-03-03") is None
    assert read_published("p", str(secret), "2026-03-03") is None  # not a metrics.json
    not_normalized = str(model / ".." / "2026-03-02" / "metrics.json")
    assert read_published("p", not_normalized, "2026-03-02") is None


def test_a_rank_log_never_writes_into_a_planted_logs_folder(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(elsewhere, run / "logs")
    log = RankLog(str(run), 0, header="started", max_bytes=4096)
    for i in range(600):
        log.write(f"step {i}\n".encode())  # would also rotate, if it had opened anything
    log.close()
    assert os.listdir(elsewhere) == []
