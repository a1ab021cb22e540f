"""Variable-length fields in the shard format: a round trip with fixed, variable and bytes fields in the
same shards (lists, padding, the loader, cached and memory-mapped), hostile offsets, sizes and manifests
refused with the field and value named, and packing token sequences into fixed-length blocks."""

from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pytest
import torch

from dtrain.errors import SpecError
from dtrain.preprocess.errors import PreprocessError
from dtrain.preprocess.runner import preprocess
from dtrain.training.shards import Padded, ShardDataset, ShardLoader, ShardSampler

from .conftest import dtrain, read_tree, write_jsonl
from .var_transforms import records, tokens_of

MIXED = "tests.preprocess.var_transforms:mixed"
TOKENS = "tests.preprocess.var_transforms:tokens"
QUIET = {"log": lambda _: None}
FIELDS = ("ids", "blob", "label")


def expected(record: dict) -> tuple[list[int], bytes, int]:
    return tokens_of(record).tolist(), f"doc-{record['id']}".encode() * (record["n"] % 3), record["id"] % 7


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> tuple[str, list[dict]]:
    root = tmp_path_factory.mktemp("var-raw")
    recs = records(500)
    return write_jsonl(str(root / "docs.jsonl"), recs), recs


@pytest.fixture(scope="module")
def mixed_shards(tmp_path_factory, raw) -> str:
    out = str(tmp_path_factory.mktemp("var-shards") / "out")
    preprocess([raw[0]], out, MIXED, workers=2, shard_size=64, **QUIET)
    return out


def manifest_of(directory: str) -> dict:
    with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as fh:
        return json.load(fh)


def test_mixed_fields_round_trip_as_lists_padded_and_through_the_loader(mixed_shards, raw, digits_shards):
    _, recs = raw
    manifest = manifest_of(mixed_shards)
    longest = max(r["n"] for r in recs)
    assert manifest["format_version"] == 2 and manifest_of(digits_shards)["format_version"] == 1  # fixed-only stays 1
    assert manifest["fields"] == {"ids": {"dtype": "int32", "variable": True, "max_length": longest},
                                  "blob": {"dtype": "bytes", "variable": True,
                                           "max_length": max(len(expected(r)[1]) for r in recs)},
                                  "label": {"dtype": "int64", "shape": []}}
    assert sorted(manifest["shards"][0]["files"]) == ["blob.offsets", "blob.values", "ids.offsets", "ids.values",
                                                      "label"]
    picks = [499, 0, 3, 250, 64, 63, -1]
    for cache_bytes in (1 << 30, 0):
        dataset = ShardDataset(mixed_shards, fields=FIELDS, cache_bytes=cache_bytes, verify=True)
        assert dataset.cached == bool(cache_bytes) and len(dataset) == 500
        ids, blobs, labels = dataset.get_batch(picks)
        want = [expected(recs[i]) for i in picks]
        assert [t.tolist() for t in ids] == [w[0] for w in want] and all(t.dtype == torch.int32 for t in ids)
        assert blobs == [w[1] for w in want] and labels.tolist() == [w[2] for w in want]
        with pytest.raises(ValueError, match="pad_value=-1 does not fit field blob's dtype bytes"):
            dataset.get_batch(picks, collate="pad", pad_value=-1)
        padded, _, _ = dataset.get_batch(picks, collate="pad", pad_value={"ids": -1})
        assert isinstance(padded, Padded) and padded.values.shape == (7, max(len(w[0]) for w in want))
        for row, mask, w in zip(padded.values, padded.mask, want):
            assert row[mask].tolist() == w[0] and set(row[~mask].tolist()) <= {-1}
            assert mask.tolist() == [True] * len(w[0]) + [False] * (len(row) - len(w[0]))
        item = dataset[250]
        assert item[0].tolist() == expected(recs[250])[0] and item[1] == expected(recs[250])[1]
        assert int(item[2]) == expected(recs[250])[2]
        items = dataset.__getitems__([250, 3])  # what a plain DataLoader fetches: per-sample items
        assert [(t.tolist(), b, int(y)) for t, b, y in items] == [expected(recs[250]), expected(recs[3])]

    mapped = ShardDataset(mixed_shards, fields=FIELDS, cache_bytes=0)
    sampler = ShardSampler(500, num_replicas=2, rank=1, seed=4, drop_last=True)
    order = sampler.indices()
    for collate in ("list", "pad"):
        loader = ShardLoader(mapped, batch_size=32, sampler=sampler, read_ahead=3, collate=collate)
        seen = []
        for ids, blobs, labels in loader:
            rows = ids if collate == "list" else [v[m] for v, m in zip(ids.values, ids.mask)]
            seen += [(t.tolist(), b, int(y)) for t, b, y in zip(rows, blobs if collate == "list" else
                                                                 [v[m].numpy().tobytes() for v, m in
                                                                  zip(blobs.values, blobs.mask)], labels)]
        assert len(seen) == len(loader) * 32 == 7 * 32
        assert seen == [expected(recs[i]) for i in order[: len(seen)]]


def test_variable_shards_are_deterministic_and_rerun_keeps_them(tmp_path, raw, mixed_shards):
    out = str(tmp_path / "again")
    preprocess([raw[0]], out, MIXED, workers=1, shard_size=64, **QUIET)
    assert read_tree(out) == read_tree(mixed_shards)  # 1 worker vs 2: byte for byte
    messages = []
    preprocess([raw[0]], out, MIXED, workers=1, shard_size=64, log=messages.append)
    assert "already complete" in messages[0]


def test_a_declared_variable_field_must_be_1d_and_bad_records_are_quarantined(tmp_path):
    recs = records(40) + [{"id": 99, "n": 3, "shape": "2d"}]
    path = write_jsonl(str(tmp_path / "docs.jsonl"), recs, raw_lines={5: '{"id": 5, "n": "many"}'})
    result = preprocess([path], str(tmp_path / "out"), MIXED, workers=1, max_bad_fraction=0.1, **QUIET)
    assert result["bad_records"] == 2 and result["num_samples"] == 39
    reasons = [json.loads(line)["reason"] for line in open(tmp_path / "out" / "quarantine.jsonl", encoding="utf-8")]
    assert any("field ids is variable-length: expected a 1-D array, got shape (2, 2)" in r for r in reasons), reasons


# ---------------------------------------------------------------------------------------------------------
# Hostile shard files and manifests: the reader refuses them, naming the field, the value and what is allowed


def hostile_copy(tmp_path, source: str) -> tuple[str, dict]:
    copy = str(tmp_path / "copy")
    shutil.copytree(source, copy)
    return copy, manifest_of(copy)


def save_manifest(copy: str, manifest: dict) -> None:
    with open(os.path.join(copy, "manifest.json"), "w", encoding="utf-8") as fh:
        json.dump(manifest, fh)


def replace_array(copy: str, manifest: dict, shard: int, key: str, array: np.ndarray) -> None:
    """Write ``array`` as a shard file and make the manifest agree on its size, as an attacker would
    (the checksum is only checked with verify=True)."""
    info = manifest["shards"][shard]["files"][key]
    np.save(os.path.join(copy, info["path"]), array)
    info["bytes"] = os.path.getsize(os.path.join(copy, info["path"]))
    save_manifest(copy, manifest)


def offsets_of(copy: str, manifest: dict, shard: int = 1) -> np.ndarray:
    return np.load(os.path.join(copy, manifest["shards"][shard]["files"]["ids.offsets"]["path"]))


@pytest.mark.parametrize("cache_bytes", [1 << 30, 0], ids=["cached", "mapped"])
@pytest.mark.parametrize("change,message", [
    (lambda o, n: o[::-1].copy(), r"offsets run from \d+ to 0; allowed: from 0 to the values' length \d+"),
    (lambda o, n: np.concatenate([o[:-1], [n + 5]]), r"offsets run from 0 to \d+; allowed: from 0 to the values' "),
    (lambda o, n: np.concatenate([o[:3], [o[3] + 10**6], o[4:]]),
     r"sample 2 has length 10000\d\d \(offsets \d+ -> 10000\d\d\); allowed: 0 to max_length=\d+"),
    (lambda o, n: np.concatenate([o[:3], [o[2]], [o[2] - 1], o[5:]]), r"sample 3 has length -1 .*must not decrease"),
    (lambda o, n: o[:-1].copy(), r"\d+ offsets for 64 samples; allowed: exactly one more than the samples \(65\)"),
    (lambda o, n: np.repeat(o, 2).astype(np.int32), r"offsets must be a 1-D int64 array, got int32 \(130,\)"),
], ids=["reversed", "past-the-end", "longer-than-max_length", "decreasing", "one-short", "int32"])
def test_hostile_offsets_are_refused(tmp_path, mixed_shards, cache_bytes, change, message):
    copy, manifest = hostile_copy(tmp_path, mixed_shards)
    values = np.load(os.path.join(copy, manifest["shards"][1]["files"]["ids.values"]["path"]))
    replace_array(copy, manifest, 1, "ids.offsets", change(offsets_of(copy, manifest), len(values)))
    dataset = ShardDataset(copy, fields=FIELDS, cache_bytes=cache_bytes)
    with pytest.raises(PreprocessError, match=message) as info:
        dataset.get_batch(range(len(dataset)))
    assert "field ids" in str(info.value) and "ids.offsets.npy" in str(info.value)


def test_values_of_another_dtype_or_a_lying_header_are_refused(tmp_path, mixed_shards):
    copy, manifest = hostile_copy(tmp_path, mixed_shards)
    path = os.path.join(copy, manifest["shards"][0]["files"]["ids.values"]["path"])
    values = np.load(path)
    replace_array(copy, manifest, 0, "ids.values", values.astype(np.int64))
    with pytest.raises(PreprocessError, match=r"holds int64 values, manifest says field ids is int32"):
        ShardDataset(copy, fields=("ids",), cache_bytes=0).get_batch([0])
    # A header claiming more values than the file holds (same size on disk): numpy refuses to map it.
    replace_array(copy, manifest, 0, "ids.values", values)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {**np.lib.format.header_data_from_array_1_0(values),
                                                  "shape": (len(values) * 1000,)})
    data = open(path, "rb").read()
    assert len(header.getvalue()) == len(data) - values.nbytes  # the same header length: only the shape lies
    open(path, "wb").write(header.getvalue() + data[len(header.getvalue()):])
    for cache_bytes in (0, 1 << 30):
        with pytest.raises(PreprocessError, match=r"is not a \.npy file this reader maps"):
            ShardDataset(copy, fields=("ids",), cache_bytes=cache_bytes).get_batch([0])


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["fields"]["ids"].update(max_length=10**9),
     r"field ids has max_length=1000000000 of int32, 4000000000 bytes a sample, above max_sample_bytes=67108864"),
    (lambda m: m["fields"]["ids"].update(max_length=-1), r"fields\.ids\.max_length=-1 is invalid: a whole number"),
    (lambda m: m["fields"]["ids"].update(dtype="object"),
     r"fields\.ids\.dtype='object' is invalid: a bool, integer or float dtype name, or 'bytes'"),
    (lambda m: m["fields"]["label"].update(shape=[1 << 30]),
     r"field label has shape=\[1073741824\] of int64, 8589934592 bytes a sample, above max_sample_bytes"),
    (lambda m: m["fields"]["label"].update(shape=[1000]),
     r"has \d+ bytes: too few for the \d+ samples of field label its manifest entry claims"),
    (lambda m: m.update(format_version=1), r"fields\.blob\.variable=True is invalid: only in format version 2 manifests"),
    (lambda m: m["shards"][0]["files"]["ids.values"].update(path="parts/../../../etc/passwd.npy"),
     r"shards\[0\]\.files\.ids\.values\.path='parts/\.\./\.\./\.\./etc/passwd\.npy' is invalid: "
     r"parts/<partition>/<file>\.npy inside the dataset"),
    (lambda m: m["shards"][0]["files"].pop("ids.offsets"), r"shards\[0\]\.files=.* is invalid: one entry per field"),
    (lambda m: m["shards"][0].update(num_samples=10**12), r"shards hold \d+ samples, manifest says 500"),
    (lambda m: m.update(format_version=3), r"version 3 is not 'dtrain-shards' version 1 or 2"),
], ids=["huge-max_length", "negative-max_length", "object-dtype", "huge-shape", "shape-beyond-file", "variable-in-v1",
        "path-traversal", "missing-offsets", "sample-count", "unknown-version"])
def test_hostile_manifests_are_refused_before_a_shard_is_read(tmp_path, mixed_shards, edit, message):
    copy, manifest = hostile_copy(tmp_path, mixed_shards)
    edit(manifest)
    save_manifest(copy, manifest)
    with pytest.raises(PreprocessError, match=message):
        ShardDataset(copy, fields=FIELDS)


# ---------------------------------------------------------------------------------------------------------
# Packing


def packed_blocks(recs: list[dict], shard_size: int, block: int, separator: int | None) -> tuple[list, int]:
    """What packing must give: per shard of ``shard_size`` records, its sequences + separator end to end,
    cut into blocks; the tail of each shard dropped."""
    blocks, dropped = [], 0
    for start in range(0, len(recs), shard_size):
        stream = []
        for rec in recs[start:start + shard_size]:
            stream += tokens_of(rec).tolist() + ([separator] if separator is not None else [])
        full = len(stream) // block * block
        blocks += [stream[i:i + block] for i in range(0, full, block)]
        dropped += len(stream) - full
    return blocks, dropped


def test_packing_cuts_fixed_blocks_with_separators(tmp_path, raw):
    path, recs = raw
    out = str(tmp_path / "packed")
    result = dtrain("preprocess", "--transform", TOKENS, "--input", path, "--output", out, "--workers", "2",
                    "--shard-size", "100", "--pack", "ids", "--block-size", "16", "--separator", "7")
    assert result.returncode == 0, result.stderr
    want, dropped = packed_blocks(recs, 100, 16, 7)
    manifest = manifest_of(out)
    assert manifest["format_version"] == 1  # the blocks are a fixed field: readers of version 1 read it
    assert manifest["fields"] == {"ids": {"dtype": "int32", "shape": [16]}}
    tokens = sum(r["n"] + 1 for r in recs)
    assert manifest["packing"] == {"field": "ids", "block_size": 16, "separator": 7, "sequences": 500,
                                   "tokens": tokens, "dropped_tokens": dropped}
    assert dropped < 5 * 16 and tokens == 16 * len(want) + dropped
    (ids,) = ShardDataset(out, fields=("ids",)).get_batch(range(manifest["num_samples"]))
    assert ids.tolist() == want

    no_separator = str(tmp_path / "plain")
    preprocess([path], no_separator, TOKENS, workers=1, shard_size=100, pack={"field": "ids", "block_size": 16},
               **QUIET)
    (ids,) = ShardDataset(no_separator, fields=("ids",)).get_batch(range(len(ShardDataset(no_separator, ("ids",)))))
    assert ids.tolist() == packed_blocks(recs, 100, 16, None)[0]


@pytest.mark.parametrize("transform,pack,error,message", [
    ("tokens_and_label", {"field": "ids", "block_size": 8}, PreprocessError,
     r"the transform returned fields \['ids', 'label'\]; a packed dataset holds only the packed field 'ids'"),
    ("tokens", {"field": "ids", "block_size": 8, "separator": 1 << 40}, PreprocessError,
     r"separator=1099511627776 does not fit field ids's dtype int32"),
    ("tokens", {"field": "ids", "block_size": 0}, SpecError, r"pack=\{'field': 'ids', 'block_size': 0\} is invalid"),
    ("tokens", {"field": "ids", "block_size": 8, "stride": 4}, SpecError, r"pack=.* is invalid"),
    ("tokens", '{"field": "../ids", "block_size": 8}', SpecError, r"pack=.* is invalid"),
], ids=["other-fields", "separator-too-big", "zero-block", "unknown-key", "bad-field-name"])
def test_packing_settings_that_cannot_work_fail_the_run(tmp_path, raw, transform, pack, error, message):
    out = tmp_path / "out"
    with pytest.raises(error, match=message):
        preprocess([raw[0]], str(out), f"tests.preprocess.var_transforms:{transform}", workers=1, pack=pack, **QUIET)
    assert not (out / "manifest.json").exists()
    if error is SpecError:  # refused before any work: nothing created
        assert not out.exists()


@pytest.mark.parametrize("mean_length", [3, 400], ids=["short: one fancy index", "long: a slice per sample"])
def test_gather_from_several_sources_in_output_order(mean_length):
    from dtrain.preprocess import ragged

    rng = np.random.default_rng(mean_length)
    sources = []
    for _ in range(3):
        samples = [rng.integers(0, 1000, rng.integers(0, 2 * mean_length), dtype=np.int32) for _ in range(50)]
        sources.append((ragged.from_samples(samples, np.dtype(np.int32)), samples))
    picks = [(int(rng.integers(3)), int(rng.integers(50))) for _ in range(40)]  # (source, row), repeats allowed
    parts = []
    for s in range(3):
        positions = np.array([p for p, (src, _) in enumerate(picks) if src == s], dtype=np.int64)
        parts.append((sources[s][0], positions, np.array([picks[p][1] for p in positions], dtype=np.int64)))
    out = ragged.gather(parts, len(picks), np.dtype(np.int32))
    assert [a.tolist() for a in ragged.split(out)] == [sources[s][1][r].tolist() for s, r in picks]
    window = out.rows(5, 9)  # a view of a block, as the loader hands out batches
    assert [a.tolist() for a in ragged.split(window)] == [sources[s][1][r].tolist() for s, r in picks[5:9]]
    values, mask = ragged.pad(window, -1)
    assert [row[m].tolist() for row, m in zip(values, mask)] == [sources[s][1][r].tolist() for s, r in picks[5:9]]
