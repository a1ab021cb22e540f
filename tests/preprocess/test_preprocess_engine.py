"""The preprocessing engine and CLI with real worker processes: determinism, idempotence, quarantine,
input formats (JSON lines, gzip, CSV, Parquet, .npy), S3 through moto's server, bad arguments."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dtrain.errors import SpecError
from dtrain.preprocess.errors import PreprocessError, TooManyBadRecords
from dtrain.preprocess.runner import finalize_dataset, preprocess, process_partition

from .conftest import DIGITS, dtrain, read_tree, write_jsonl

QUIET = {"log": lambda _: None}


def partitions(raw: str) -> list[str]:
    return sorted(os.path.join(raw, n) for n in os.listdir(raw))


def test_two_cli_runs_give_byte_identical_shards(tmp_path, digits_raw):
    from dtrain.training.reference.train_digits import load_digits_split
    from dtrain.training.shards import ShardDataset

    outs = [str(tmp_path / f"out{i}") for i in range(2)]
    for out in outs:
        args = ["preprocess", "--transform", DIGITS, "--output", out, "--workers", "2", "--shard-size", "100"]
        for path in partitions(digits_raw):
            args += ["--input", path]
        result = dtrain(*args)
        assert result.returncode == 0, result.stderr
        assert "1437 samples" in result.stdout
    first, second = read_tree(outs[0]), read_tree(outs[1])
    assert len([p for p in first if p.endswith(".npy")]) == 2 * 15  # x and y of ceil(479/100) shards x 3
    assert first == second  # every shard, index, quarantine and the manifest, byte for byte
    assert not [p for p in first if os.path.basename(p).startswith(".")]  # no temp file left behind

    # The shards hold exactly the reference script's training split.
    dataset = ShardDataset(outs[0], verify=True)
    x, y = dataset.get_batch(range(len(dataset)))
    (x_ref, y_ref), _ = load_digits_split(0)
    key = lambda xs, ys: sorted(zip(ys.tolist(), map(bytes, np.asarray(xs))))  # noqa: E731
    assert key(x.numpy(), y.numpy()) == key(x_ref, y_ref)


def test_worker_count_does_not_change_the_shards(tmp_path, digits_raw, digits_shards):
    out = str(tmp_path / "out")
    preprocess(partitions(digits_raw), out, DIGITS, workers=2, shard_size=200, **QUIET)
    assert read_tree(out) == read_tree(digits_shards)  # the fixture ran with one worker


def test_rerun_is_idempotent_and_keeps_every_file(tmp_path, digits_raw):
    out = str(tmp_path / "out")
    preprocess(partitions(digits_raw)[:1], out, DIGITS, workers=1, shard_size=200, **QUIET)
    before = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in read_tree(out) if "parts" in p}
    messages = []
    preprocess(partitions(digits_raw)[:1], out, DIGITS, workers=1, shard_size=200, log=messages.append)
    after = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in read_tree(out) if "parts" in p}
    assert before == after
    assert any("already complete" in m for m in messages)


def bad_digits_file(path: str, repeat: int = 2) -> tuple[str, int]:
    from dtrain.preprocess.examples import digits_records

    records = digits_records(repeat=repeat)
    records[29]["label"] = None  # dropped by the transform: not a bad record
    raw = {10: '{"id": "broken", "pixels": [1, 2', 20: json.dumps({"id": "x", "pixels": [99] * 64, "label": 3})}
    return write_jsonl(path, records, raw), len(records)


def test_quarantine_below_threshold_publishes_and_records_file_line_reason(tmp_path):
    raw, n = bad_digits_file(str(tmp_path / "raw.jsonl"))
    out = str(tmp_path / "out")
    result = preprocess([raw], out, DIGITS, workers=2, shard_size=500, **QUIET)  # 2 bad of 2874 < 0.1%
    assert result["bad_records"] == 2 and result["dropped"] == 1 and result["num_samples"] == n - 3
    with open(os.path.join(out, "quarantine.jsonl"), encoding="utf-8") as fh:
        bad = [json.loads(line) for line in fh]
    assert [(b["line"], b["file"]) for b in bad] == [(10, "file://" + raw), (20, "file://" + raw)]
    assert bad[0]["reason"].startswith("JSONDecodeError") and "pixels must be 64 values in [0, 16]" in bad[1]["reason"]
    manifest = json.load(open(os.path.join(out, "manifest.json"), encoding="utf-8"))
    assert manifest["num_samples"] == n - 3 and manifest["bad_records"] == 2
    assert manifest["fields"] == {"x": {"dtype": "float32", "shape": [64]}, "y": {"dtype": "int64", "shape": []}}
    assert manifest["transform"]["name"] == DIGITS and manifest["transform"]["version"] == "1"


def test_quarantine_above_threshold_fails_and_publishes_nothing(tmp_path):
    raw, n = bad_digits_file(str(tmp_path / "raw.jsonl"), repeat=1)  # 2 bad of 1437: 0.14% > 0.1%
    out = str(tmp_path / "out")
    result = dtrain("preprocess", "--transform", DIGITS, "--input", raw, "--output", out, "--workers", "1")
    assert result.returncode == 2
    assert "2 of 1437 records are bad" in result.stderr and "max_bad_fraction=0.001" in result.stderr
    assert os.path.join(out, "quarantine.jsonl") in result.stderr
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    with open(os.path.join(out, "quarantine.jsonl"), encoding="utf-8") as fh:
        assert [json.loads(line)["line"] for line in fh] == [10, 20]
    # The same data under a looser threshold is published.
    result = dtrain("preprocess", "--transform", DIGITS, "--input", raw, "--output", out, "--workers", "1",
                    "--max-bad-fraction", "0.01")
    assert result.returncode == 0, result.stderr
    assert json.load(open(os.path.join(out, "manifest.json"), encoding="utf-8"))["num_samples"] == n - 3


def test_mapped_task_above_threshold_fails_its_partition(tmp_path):
    raw, _ = bad_digits_file(str(tmp_path / "raw.jsonl"), repeat=1)
    with pytest.raises(TooManyBadRecords, match="partition raw-.*2 of 1437"):
        process_partition(raw, str(tmp_path / "out"), DIGITS, workers=1, **QUIET)
    with pytest.raises(PreprocessError, match="not finished"):
        finalize_dataset(str(tmp_path / "out"), ["raw"], **QUIET)
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_csv_parquet_npy_and_gzip_inputs(tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dtrain.training.shards import ShardDataset

    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "a.csv").write_text("value,label\n1.5,1\n\n2.5,2\nnot-a-number,3\n4,5,6\n")
    out = str(tmp_path / "csv-out")
    result = preprocess([str(tmp_path / "csv")], out, "tests.preprocess.prep_transforms:csv_row",
                        workers=1, max_bad_fraction=0.5, **QUIET)
    assert result["num_samples"] == 2 and result["bad_records"] == 2
    bad = [json.loads(line) for line in open(os.path.join(out, "quarantine.jsonl"), encoding="utf-8")]
    assert [b["line"] for b in bad] == [5, 6] and "header has 2" in bad[1]["reason"]
    assert ShardDataset(out).get_batch([0, 1])[0].tolist() == [1.5, 2.5]

    from dtrain.preprocess.examples import digits_records

    records = digits_records()[:300]
    pq.write_table(pa.Table.from_pylist(records), str(tmp_path / "d.parquet"), row_group_size=64)
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    outs = {}
    for name in ("d.parquet", "d.jsonl.gz"):
        outs[name] = str(tmp_path / f"out-{name}")
        preprocess([str(tmp_path / name)], outs[name], DIGITS, workers=1, shard_size=128, **QUIET)
    a, b = (ShardDataset(o).get_batch(range(300)) for o in outs.values())
    assert all((u == v).all() for u, v in zip(a, b))

    rows = np.column_stack([np.arange(50), np.random.default_rng(0).random((50, 3))])
    np.save(tmp_path / "rows.npy", rows)
    out = str(tmp_path / "npy-out")
    preprocess([str(tmp_path / "rows.npy")], out, "tests.preprocess.prep_transforms:indexed_row",
               workers=1, shard_size=16, **QUIET)
    i, x = ShardDataset(out, fields=("i", "x")).get_batch(range(50))
    assert i.tolist() == list(range(50)) and np.allclose(x.numpy(), rows[:, 1:].astype(np.float32))


def test_s3_input_and_output_through_moto(tmp_path, s3_bucket, digits_raw):
    import fsspec

    from dtrain.training.shards import ShardDataset

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    for path in partitions(digits_raw)[:2]:
        fs.put_file(path, f"{s3_bucket}/day=2024-01-01/{os.path.basename(path)}")
    out = f"s3://{s3_bucket}/shards/2024-01-01"
    result = preprocess([f"s3://{s3_bucket}/day=2024-01-01/"], out, DIGITS, workers=2, shard_size=200, **QUIET)
    assert result["num_samples"] == 958 and result["manifest"] == out + "/manifest.json"
    fs.invalidate_cache()
    local = str(tmp_path / "staged")
    fs.get(f"{s3_bucket}/shards/2024-01-01/", local, recursive=True)  # what the staging step does, in short
    assert len(ShardDataset(local, verify=True)) == 958


def test_s3_input_line_above_the_limit_is_quarantined(tmp_path, s3_bucket):
    """fsspec's remote files take no size in readline (and read to the newline whatever its
    distance): the reader wraps them so that the per-record limit holds there too."""
    import fsspec

    from dtrain.preprocess.examples import digits_records

    lines = [json.dumps(r).encode() for r in digits_records()[:30]]
    lines[4] = b'{"pad": "' + b"a" * (3 << 20) + b'"}'
    fsspec.filesystem("s3", skip_instance_cache=True).pipe_file(f"{s3_bucket}/long/part.jsonl", b"\n".join(lines) + b"\n")
    out = str(tmp_path / "out")
    result = preprocess([f"s3://{s3_bucket}/long/part.jsonl"], out, DIGITS, workers=1, max_bad_fraction=0.1,
                        max_record_bytes=1024, **QUIET)
    assert result["num_samples"] == 29 and result["bad_records"] == 1
    bad = json.loads(open(os.path.join(out, "quarantine.jsonl"), encoding="utf-8").read())
    assert bad["line"] == 5 and f"the record is {(3 << 20) + 11} bytes, above max_record_bytes=1024" in bad["reason"]


@pytest.mark.parametrize("kwargs, field", [
    ({"workers": 0}, "workers"), ({"max_bad_fraction": 2}, "max_bad_fraction"),
    ({"shard_size": 0}, "shard_size"), ({"transform": "no.such.module:fn"}, "transform"),
    ({"transform": "dtrain.preprocess.examples:NOPE"}, "transform"), ({"inputs": ["/no/such/dir"]}, "input"),
])
def test_bad_arguments_fail_before_any_work(tmp_path, digits_raw, kwargs, field):
    out = tmp_path / "out"
    args = {"inputs": partitions(digits_raw)[:1], "output": str(out), "transform": DIGITS, **kwargs}
    with pytest.raises(SpecError) as info:
        preprocess(**args, **QUIET)
    assert info.value.field == field and str(info.value).startswith(f"{field}=")
    assert not out.exists()


def test_reader_refuses_unpublished_truncated_or_corrupt_shards(tmp_path, digits_shards):
    import shutil

    from dtrain.training.shards import ShardDataset

    with pytest.raises(PreprocessError, match="manifest.json is missing"):
        ShardDataset(str(tmp_path))
    copy = str(tmp_path / "copy")
    shutil.copytree(digits_shards, copy)
    manifest = json.load(open(os.path.join(copy, "manifest.json"), encoding="utf-8"))
    victim = os.path.join(copy, manifest["shards"][1]["files"]["x"]["path"])
    data = bytearray(open(victim, "rb").read())
    data[-1] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    ShardDataset(copy)  # same size: only the checksum can tell
    with pytest.raises(PreprocessError, match="does not match its SHA-256"):
        ShardDataset(copy, verify=True)
    open(victim, "wb").write(bytes(data[:-4]))
    with pytest.raises(PreprocessError, match="bytes, manifest says"):
        ShardDataset(copy)
    with pytest.raises(PreprocessError, match=r"fields \['z'\] are not in the dataset"):
        ShardDataset(digits_shards, fields=("x", "z"))


def test_workers_do_not_rerun_the_callers_main(tmp_path, digits_raw):
    """Spawned workers must not import the caller's __main__ (under Airflow's LocalExecutor that is
    the airflow CLI, which cannot be imported in a task process)."""
    import subprocess
    import sys

    from .conftest import child_env

    script = tmp_path / "caller.py"
    script.write_text(
        "import sys\n"
        "if __name__ != '__main__':\n"
        "    raise SystemExit('caller re-imported in a worker')\n"
        "from dtrain.preprocess.runner import preprocess\n"
        f"r = preprocess([{partitions(digits_raw)[0]!r}], sys.argv[1], {DIGITS!r}, workers=2, shard_size=100)\n"
        "print('samples', r['num_samples'])\n")
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=120, env=child_env())
    assert result.returncode == 0, result.stderr[-2000:]
    assert "samples 479" in result.stdout


@pytest.mark.parametrize("library", ["multiprocessing", "billiard"])
def test_workers_start_inside_a_daemonic_process_as_celery_runs_tasks(tmp_path, digits_raw, library):
    """The CeleryExecutor runs a task in a process forked from its pool's daemonic worker process (billiard's,
    Celery's fork of multiprocessing), where multiprocessing refused the workers: "daemonic processes are not
    allowed to have children", then billiard's authentication key, which spawn would not pickle."""
    import subprocess
    import sys

    from .conftest import child_env

    script = tmp_path / "pool_task.py"
    script.write_text(
        f"import multiprocessing, sys, {library}\n"
        "from dtrain.preprocess.runner import preprocess\n"
        "def task(out):\n"
        f"    r = preprocess([{partitions(digits_raw)[0]!r}], out, {DIGITS!r}, workers=2, shard_size=100)\n"
        "    print('samples', r['num_samples'], 'daemonic', multiprocessing.current_process().daemon, flush=True)\n"
        "if __name__ == '__main__':\n"
        f"    worker = {library}.get_context('fork').Process(target=task, args=(sys.argv[1],), daemon=True)\n"
        "    worker.start()\n"
        "    worker.join()\n"
        "    sys.exit(worker.exitcode)\n")
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=120, env=child_env())
    assert result.returncode == 0, result.stderr[-2000:]
    assert "samples 479 daemonic True" in result.stdout  # the flag is back once the workers started


def test_fields_that_differ_between_shards_fail_finalize(tmp_path):
    (tmp_path / "in").mkdir()
    np.save(tmp_path / "in" / "a.npy", np.column_stack([np.arange(10), np.ones((10, 3))]))
    np.save(tmp_path / "in" / "b.npy", np.column_stack([np.arange(10), np.ones((10, 2))]))
    with pytest.raises(PreprocessError, match="same field names, dtypes and shapes"):
        preprocess([str(tmp_path / "in")], str(tmp_path / "out"), "tests.preprocess.prep_transforms:indexed_row",
                   workers=1, **QUIET)
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_operator_on_kill_stops_its_workers(tmp_path, digits_raw, monkeypatch):
    import threading
    import time

    import psutil

    from dtrain.preprocess.operator import PreprocessOperator

    monkeypatch.setenv("PREP_TEST_SLEEP_S", "0.02")  # inherited by the spawned workers
    op = PreprocessOperator(task_id="p", transform="tests.preprocess.prep_transforms:digits_slow",
                            input=partitions(digits_raw)[0], output_path=str(tmp_path / "out"), workers="2",
                            shard_size="20")
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_capture(op.execute, {})))
    thread.start()
    def pool_workers():  # not multiprocessing's resource tracker, which lives as long as this process
        return [p for p in psutil.Process().children() if "spawn_main" in command_line(p)]

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(pool_workers()) < 2:
        time.sleep(0.05)
    workers = pool_workers()
    assert len(workers) >= 2
    op.on_kill()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(errors[0], PreprocessError) and "a worker failed" in str(errors[0])
    _, alive = psutil.wait_procs(workers, timeout=20)
    assert alive == []
    assert not list((tmp_path / "out").glob("parts/*/_partition.json"))  # the partition is not marked done


def command_line(proc) -> str:
    """Its command line, or "" for a child that is gone or a zombie (another fixture's child of
    this process may exit at any time, and a zombie has no command line to read)."""
    import psutil

    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def _capture(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # the test thread hands the error back for the assertion
        return e
