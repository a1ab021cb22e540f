"""The per-record size limit (max_record_bytes): a decompression bomb (one huge line in a small
.gz) is quarantined while it is read, never held in memory; .npy rows and Parquet row groups are
bounded too; a bad limit is refused (exit status 2) before anything is created."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dtrain.errors import SpecError
from dtrain.preprocess.errors import PreprocessError, TooManyBadRecords
from dtrain.preprocess.inputs import (DEFAULT_MAX_RECORD_BYTES, READ_BLOCK, InputFile, OversizedRecord, iter_chunks,
                                      read_line)
from dtrain.preprocess.runner import preprocess

from .conftest import DIGITS, REPO, child_env, dtrain

QUIET = {"log": lambda _: None}
MIB = 1 << 20


def digits(n: int) -> list[dict]:
    from dtrain.preprocess.examples import digits_records

    return digits_records()[:n]


def huge_record_chunks(pad: int, block: int = MIB):
    """A JSON record the digits transform would accept, padded to ``pad`` bytes, in pieces: the
    test never holds the whole line either."""
    yield b'{"id": "huge", "pixels": ' + json.dumps([0] * 64).encode() + b', "label": 1, "pad": "'
    for start in range(0, pad, block):
        yield b"a" * min(block, pad - start)
    yield b'"}\n'


def write_with_huge_line(path: str, records: list[dict], huge_at: int, pad: int, opener=open) -> None:
    """``records`` as JSON lines with a huge (still valid) record inserted as line ``huge_at``."""
    with opener(path, "wb") as fh:
        for line_no, record in enumerate(records, 1):
            if line_no == huge_at:
                for piece in huge_record_chunks(pad):
                    fh.write(piece)
            fh.write(json.dumps(record).encode() + b"\n")


def quarantine(out: str) -> list[dict]:
    with open(os.path.join(out, "quarantine.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def manifest(out: str) -> dict:
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as fh:
        return json.load(fh)


# --- the decompression bomb, measured -------------------------------------------------------------

def peak_rss_run(*args: str) -> tuple[subprocess.CompletedProcess, int]:
    """``dtrain ARGS`` in a fresh process; its peak RSS in bytes."""
    result = subprocess.run([sys.executable, "-m", "tests.preprocess.peak_rss", *args], capture_output=True, text=True,
                            timeout=120, env=child_env(), cwd=REPO)
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("PEAK_RSS_KIB "), result.stdout[-2000:] + result.stderr[-2000:]
    return result, int(last.split()[1]) * 1024


def test_gzip_bomb_line_is_quarantined_without_being_held_in_memory(tmp_path):
    """The review's finding: a ~200 KB .jsonl.gz holding one 200 MiB line took preprocess to
    gigabytes. With the default limit (64 MiB) the line is skipped while it is read: the run's
    peak stays far below the line's size, the line is quarantined naming the limit, and the good
    records are published."""
    line_bytes = 200 * MIB
    records = digits(50)
    bomb, plain = str(tmp_path / "bomb.jsonl.gz"), str(tmp_path / "plain.jsonl.gz")
    gz = lambda p, m: gzip.open(p, m, compresslevel=6)  # noqa: E731
    write_with_huge_line(bomb, records, huge_at=26, pad=line_bytes, opener=gz)
    write_with_huge_line(plain, records, huge_at=0, pad=0, opener=gz)
    assert os.path.getsize(bomb) < 1 * MIB  # the bomb: small on disk

    common = ["preprocess", "--transform", DIGITS, "--workers", "1", "--max-bad-fraction", "0.05"]
    base, base_peak = peak_rss_run(*common, "--input", plain, "--output", str(tmp_path / "plain-out"))
    assert base.returncode == 0, base.stderr[-2000:]
    result, peak = peak_rss_run(*common, "--input", bomb, "--output", str(tmp_path / "bomb-out"))
    assert result.returncode == 0, result.stderr[-2000:]

    # Without the limit the line alone is 200 MiB (and copies of it more): the run stays within
    # about the limit (64 MiB) and a read block above the same run without the line.
    print(f"peak RSS: {base_peak / MIB:.0f} MiB without the huge line, {peak / MIB:.0f} MiB with it")
    assert peak - base_peak < 150 * MIB, (base_peak, peak)

    out = str(tmp_path / "bomb-out")
    bad = quarantine(out)
    assert [(b["line"], b["file"]) for b in bad] == [(26, "file://" + bomb)]
    assert bad[0]["reason"].startswith("RecordTooLarge: ")
    assert f"max_record_bytes={DEFAULT_MAX_RECORD_BYTES}" in bad[0]["reason"]
    assert bad[0]["excerpt"].startswith('{"id": "huge"') and len(bad[0]["excerpt"]) <= 200
    assert manifest(out)["num_samples"] == 50 and manifest(out)["bad_records"] == 1
    from dtrain.training.shards import ShardDataset

    ours, theirs = (ShardDataset(o).get_batch(range(50)) for o in (out, str(tmp_path / "plain-out")))
    assert all((a == b).all() for a, b in zip(ours, theirs))  # exactly the good records, in order


# --- the same with a tiny limit: fast ---------------------------------------------------------------

@pytest.mark.parametrize("name, opener", [("raw.jsonl", open), ("raw.jsonl.gz", gzip.open)], ids=["plain", "gzip"])
def test_line_above_a_small_limit_is_quarantined_and_the_rest_kept(tmp_path, name, opener):
    raw = str(tmp_path / name)
    write_with_huge_line(raw, digits(40), huge_at=7, pad=10 * 1024, opener=opener)
    out = str(tmp_path / "out")
    result = preprocess([raw], out, DIGITS, workers=1, shard_size=16, max_bad_fraction=0.05,
                        max_record_bytes=1024, **QUIET)
    assert result["bad_records"] == 1 and result["num_samples"] == 40
    (bad,) = quarantine(out)
    assert bad["line"] == 7 and bad["reason"].startswith("RecordTooLarge: the record is ")
    assert "max_record_bytes=1024 (1 KiB)" in bad["reason"] and "never held in memory" in bad["reason"]
    assert bad["excerpt"].startswith('{"id": "huge"')
    # The same record under the default limit is a good one: only the limit made it bad.
    assert preprocess([raw], str(tmp_path / "default"), DIGITS, workers=1, **QUIET)["num_samples"] == 41


def test_oversized_records_count_against_max_bad_fraction(tmp_path):
    raw = str(tmp_path / "raw.jsonl")
    write_with_huge_line(raw, digits(40), huge_at=3, pad=4096)
    out = tmp_path / "out"
    with pytest.raises(TooManyBadRecords, match=r"1 of 41 records are bad"):
        preprocess([raw], str(out), DIGITS, workers=1, max_record_bytes=1024, **QUIET)
    assert not (out / "manifest.json").exists()
    assert json.loads((out / "quarantine.jsonl").read_text())["line"] == 3


def test_two_worker_processes_get_the_oversized_record_as_a_bad_record(tmp_path):
    raw = str(tmp_path / "raw.jsonl")
    write_with_huge_line(raw, digits(40), huge_at=20, pad=4096)
    out = str(tmp_path / "out")
    preprocess([raw], out, DIGITS, workers=2, shard_size=8, max_bad_fraction=0.05, max_record_bytes=1024, **QUIET)
    assert [b["line"] for b in quarantine(out)] == [20] and manifest(out)["num_samples"] == 40


def test_changing_the_limit_recomputes_instead_of_reusing_shards(tmp_path):
    raw = str(tmp_path / "raw.jsonl")
    write_with_huge_line(raw, digits(40), huge_at=5, pad=4096)
    out = str(tmp_path / "out")
    first = preprocess([raw], out, DIGITS, workers=1, max_bad_fraction=0.05, max_record_bytes=1024, **QUIET)
    second = preprocess([raw], out, DIGITS, workers=1, max_bad_fraction=0.05, **QUIET)
    assert (first["bad_records"], second["bad_records"]) == (1, 0) and second["num_samples"] == 41


class CountingStream(io.BufferedReader):
    """Records the largest piece any single readline returned."""

    largest = 0

    def readline(self, size=-1):
        part = super().readline(size)
        self.largest = max(self.largest, len(part))
        return part


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b""])
def test_read_line_gives_up_a_long_line_without_reading_it_whole(ending):
    long = b"x" * (10 * READ_BLOCK + 5)
    stream = CountingStream(io.BytesIO(b"ok\n" + long + ending + (b"after\n" if ending else b"")))
    assert read_line(stream, 1024) == b"ok\n"
    skipped = read_line(stream, 1024)
    assert skipped == OversizedRecord(len(long), 1024, long[:200])
    assert stream.largest <= READ_BLOCK  # never more than one block at a time
    assert read_line(stream, 1024) == (b"after\n" if ending else b"")


@pytest.mark.parametrize("content, ending, kept", [
    (1024, b"\n", True), (1024, b"\r\n", True), (1024, b"", True), (1025, b"\n", False), (1025, b"", False),
    (3 * READ_BLOCK, b"\n", True), (3 * READ_BLOCK + 1, b"\r\n", False),
])
def test_read_line_limit_counts_the_record_without_its_line_ending(content, ending, kept):
    limit = 1024 if content < READ_BLOCK else 3 * READ_BLOCK
    line = b"y" * content + ending
    got = read_line(io.BufferedReader(io.BytesIO(line)), limit)
    assert got == line if kept else got == OversizedRecord(content, limit, line[:200])


# --- CSV, .npy and Parquet --------------------------------------------------------------------------

def test_csv_row_above_the_limit_is_quarantined_and_a_huge_header_refuses_the_file(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_text("value,label\n1.5,1\n" + "9" * 3000 + ",2\n2.5,2\n")
    out = str(tmp_path / "out")
    result = preprocess([str(tmp_path / "in")], out, "tests.preprocess.prep_transforms:csv_row", workers=1,
                        max_bad_fraction=0.5, max_record_bytes=1024, **QUIET)
    assert result["num_samples"] == 2 and [b["line"] for b in quarantine(out)] == [3]
    (tmp_path / "wide.csv").write_text(",".join(f"c{i}" for i in range(500)) + "\n1\n")
    with pytest.raises(PreprocessError, match=r"line 1 \(the CSV header\) is \d+ bytes, above max_record_bytes=1024"):
        preprocess([str(tmp_path / "wide.csv")], str(tmp_path / "out2"), "tests.preprocess.prep_transforms:csv_row",
                   workers=1, max_record_bytes=1024, **QUIET)


def npy_file(path: str, size: int | None = None) -> InputFile:
    return InputFile(path, "npy", size or os.path.getsize(path), "test")


def npy_header(shape: tuple, dtype: str = "<f8", fortran: bool = False) -> bytes:
    """A .npy header with no data behind it: what a hostile file may declare."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": fortran, "shape": shape})
    return buf.getvalue()  # magic, version and header


@pytest.mark.parametrize("array", [
    np.arange(300, dtype="<f8").reshape(100, 3), np.arange(300, dtype=">i4").reshape(100, 3),
    np.asfortranarray(np.arange(300, dtype="<f4").reshape(100, 3)), np.arange(7, dtype="<i8"),
    np.zeros(9, dtype=[("a", "<i4"), ("b", "<f8", (2,))]), np.zeros((5, 0)),
], ids=["c-order", "big-endian", "fortran", "1-d", "structured", "empty-rows"])
def test_npy_is_read_a_chunk_of_rows_at_a_time_and_gives_what_np_load_gives(tmp_path, array):
    path = str(tmp_path / "a.npy")
    np.save(path, array)
    chunks = list(iter_chunks(npy_file(path), 16, max_record_bytes=1024))
    assert [c.first_line for c in chunks] == list(range(1, len(array) + 1, 16))
    assert {c.records.dtype for c in chunks} == {array.dtype}  # byte order and fields as saved
    got = np.concatenate([c.records for c in chunks])
    assert got.shape == array.shape and (got == array).all()


def test_npy_rows_above_the_limit_are_refused_from_the_header_alone(tmp_path):
    path = tmp_path / "bomb.npy"
    path.write_bytes(npy_header((2, 1 << 40)))  # rows of 8 TiB: nothing behind the header
    with pytest.raises(PreprocessError, match=r"rows are 8796093022208 bytes each, above max_record_bytes=67108864"):
        list(iter_chunks(npy_file(str(path)), 16))


def test_npy_with_more_rows_declared_than_present_fails_after_one_chunk(tmp_path):
    path = tmp_path / "short.npy"
    path.write_bytes(npy_header((1 << 40, 4)) + b"\0" * 64)  # declares 2**40 rows: only one chunk is allocated
    with pytest.raises(PreprocessError, match=r"truncated \(64 of 512 bytes of a chunk\)"):
        list(iter_chunks(npy_file(str(path)), 16))


def test_fortran_npy_is_read_whole_only_within_the_limit_or_its_uncompressed_file(tmp_path):
    array = np.asfortranarray(np.zeros((1000, 4)))  # 32000 bytes, rows of 32
    with gzip.open(tmp_path / "f.npy.gz", "wb") as fh:
        np.save(fh, array)
    with pytest.raises(PreprocessError, match=r"Fortran-order array is read whole, and its 32000 bytes are above "
                                              r"max_record_bytes=1024 \(1 KiB\) \(it is compressed\)"):
        list(iter_chunks(npy_file(str(tmp_path / "f.npy.gz")), 16, max_record_bytes=1024))
    np.save(tmp_path / "f.npy", array)  # uncompressed: as large on disk as in memory, so read whole
    chunks = iter_chunks(npy_file(str(tmp_path / "f.npy")), 16, max_record_bytes=1024)
    assert sum(len(c.records) for c in chunks) == 1000
    lying = tmp_path / "lying.npy"  # declares 64 GiB of Fortran data (rows of 64 bytes) in a file of 200 bytes
    lying.write_bytes(npy_header((1 << 30, 8), fortran=True) + b"\0" * 64)
    with pytest.raises(PreprocessError, match=r"its 68719476736 bytes are above .* and the file's \d+; save it in C"):
        list(iter_chunks(npy_file(str(lying)), 16, max_record_bytes=1024))


def test_npy_object_arrays_are_refused(tmp_path):
    path = tmp_path / "o.npy"
    path.write_bytes(npy_header((3,), dtype="|O"))
    with pytest.raises(PreprocessError, match="object array needs pickle"):
        list(iter_chunks(npy_file(str(path)), 16))


def test_parquet_row_group_averaging_above_the_limit_is_refused_before_decoding(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"x": 1.0, "blob": "a" * 10}] * 20 + [{"x": 2.0, "blob": "b" * 200_000}]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "d.parquet"), row_group_size=20, compression="gzip")
    file = InputFile(str(tmp_path / "d.parquet"), "parquet", 0, "test")
    with pytest.raises(PreprocessError, match=r"row group 1 declares \d+ bytes for 1 row\(s\), more than "
                                              r"max_record_bytes=65536 \(64 KiB\) per row; nothing decoded"):
        list(iter_chunks(file, 8, max_record_bytes=65536))
    assert sum(len(c.records) for c in iter_chunks(file, 8)) == 21  # the default limit reads it


# --- a bad limit: exit status 2, nothing created ----------------------------------------------------

LIMIT_ALLOWED = f"is invalid: a whole number of bytes from 1 to {1 << 40}"


@pytest.mark.parametrize("option, value, message", [
    *[("--max-record-bytes", v, f"max_record_bytes={v!r} {LIMIT_ALLOWED}")
      for v in ("0", "-1", "abc", "1.5", "", str((1 << 40) + 1))],
    ("--workers", "0", "workers=0 is invalid: a positive integer"),
    ("--shard-size", "0", "shard_size=0 is invalid: a positive integer"),
    ("--max-bad-fraction", "2", "max_bad_fraction=2.0 is invalid: a fraction between 0 and 1"),
    ("--transform", "no.such.module:fn", "transform='no.such.module:fn' is invalid: an import path MODULE:FUNCTION"),
    # a second --input: every input is checked before the first one is processed
    ("--input", "/no/such/dir", "input='/no/such/dir' is invalid: an existing file, directory or glob"),
])
def test_bad_option_exits_2_naming_field_value_and_allowed_before_creating_anything(tmp_path, digits_raw, capsys,
                                                                                    option, value, message):
    from dtrain.cli import main

    out = tmp_path / "out"
    raw = os.path.join(digits_raw, sorted(os.listdir(digits_raw))[0])
    rc = main(["preprocess", "--transform", DIGITS, "--input", raw, "--output", str(out), option, value])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"dtrain preprocess: error: {message}" in err
    assert not out.exists()


def test_bad_max_record_bytes_from_the_installed_cli(tmp_path, digits_raw):
    out = tmp_path / "out"
    raw = os.path.join(digits_raw, sorted(os.listdir(digits_raw))[0])
    result = dtrain("preprocess", "--transform", DIGITS, "--input", raw, "--output", str(out),
                    "--max-record-bytes", "-1")
    assert result.returncode == 2
    assert "dtrain preprocess: error: max_record_bytes='-1' is invalid: a whole number of bytes" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("value", [0, -5, True, "64", 2.0, None])
def test_engine_refuses_a_bad_limit_before_any_work(tmp_path, digits_raw, value):
    out = tmp_path / "out"
    with pytest.raises(SpecError) as info:
        preprocess([digits_raw], str(out), DIGITS, max_record_bytes=value, **QUIET)
    assert info.value.field == "max_record_bytes" and "a whole number of bytes" in info.value.allowed
    assert not out.exists()


def test_operator_takes_a_rendered_limit_and_refuses_a_bad_one(tmp_path, digits_raw):
    from dtrain.preprocess.operator import PreprocessOperator

    raw = os.path.join(digits_raw, sorted(os.listdir(digits_raw))[0])
    assert "max_record_bytes" in PreprocessOperator.template_fields
    ok = PreprocessOperator(task_id="p", transform=DIGITS, input=raw, output_path=str(tmp_path / "ok"), workers="1",
                            max_record_bytes="1024")
    assert ok.execute({})["records"] == 479
    bad = PreprocessOperator(task_id="p", transform=DIGITS, input=raw, output_path=str(tmp_path / "bad"),
                             max_record_bytes="64MiB")
    with pytest.raises(SpecError, match=r"max_record_bytes='64MiB' is invalid"):
        bad.execute({})
    assert not (tmp_path / "bad").exists()
