"""Benchmark: our shard format and reader against the formats a team would otherwise pick.

The same preprocessed samples are written with each library's own writer and read back with
each library's recommended reading path, on the local disk of the machine it runs on:

  dtrain shards   the preprocess engine (PreprocessOperator / `dtrain preprocess`) writes them;
                  ShardDataset + ShardSampler + ShardLoader read them
  MDS             mosaicml-streaming: MDSWriter / StreamingDataset + torch DataLoader
  WebDataset      webdataset: ShardWriter (tar) / WebDataset(...).shuffle().decode().batched() + WebLoader
  LitData         litdata: optimize() / StreamingDataset + StreamingDataLoader

Four datasets: the digits_heavy samples (x float32 (64,), y int64; made by our engine from raw
JSON lines), random 3x64x64 uint8 images with an int64 label (about 200 MB), and token sequences
(int32 ids below GPT-2's 50257, one document each, lengths log-normal: median 256 tokens, sigma 1,
8 to 8192, the long tail of web text) read two ways: unpacked (one variable-length sample per
document) and packed (documents + end-of-text cut into 512-token blocks by our engine's packing; the
peers get those very blocks). Every format gets the same samples, about 16 shards each (WebDataset
splits whole shards between ranks and loader workers), and is written by one process. Hugging Face
datasets (Arrow: Dataset.from_parquet / from_dict + save_to_disk, read through a DataLoader) is a
peer on the text; LitData also reads the packed tokens with its language-model path, TokensLoader.

Per format: write time, size on disk, read throughput (samples/s) for one reader and for 2
DDP ranks (2 processes, torch.distributed gloo initialised as a training script would, each
reading its disjoint part, reshuffled every epoch; aggregate samples/s), time to first batch
(constructing the dataset and loader -> first batch in hand) and peak memory of the reading
process tree, every rank and loader worker (polled from outside: RSS, which counts the
memory-mapped file pages of the page cache, and private = proportional share of anonymous +
shared memory). Each measurement runs in a fresh process; batches are 256 samples; loader
workers 0 for every format (ours has none), plus 2 for each peer alone. The page cache is
warm: after each write, os.sync() and one read of every file (nothing is dropped).

Then preprocessing throughput: our engine (2 processes) versus Hugging Face datasets
(load_dataset("json") + Dataset.map(num_proc=2) + save_to_disk) on the same raw JSON lines
with the same digits_heavy transform (the outputs are checked equal), alternating, best of
--rounds each: on a shared machine the best run is the one least disturbed.

    pip install '.[bench]'     # or: DTRAIN_EXTRAS=test,bench bash scripts/bootstrap.sh
    .venv/bin/python bench/data_formats.py [--repeat 8] [--images 16384] [--docs 32768] [--only text]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from dtrain.preprocess.packing import Packing, pack  # noqa: E402
from dtrain.preprocess.ragged import Ragged  # noqa: E402
from dtrain.preprocess.transform import variable_length  # noqa: E402

HEAVY = "dtrain.preprocess.examples:digits_heavy"
ROW_FIELDS = "bench.data_formats:row_fields"  # pass-through transform: the samples are already made
TOKEN_FIELDS = "bench.data_formats:token_fields"
FORMATS = ("dtrain", "mds", "webdataset", "litdata")
TEXT_FORMATS = FORMATS + ("datasets",)
NAMES = {"dtrain": "dtrain shards", "dtrain-mapped": "dtrain, cache_bytes=0", "dtrain-pad": "dtrain, collate=pad",
         "mds": "MDS (streaming)", "webdataset": "WebDataset", "litdata": "LitData",
         "litdata-tokens": "LitData, TokensLoader", "datasets": "HF datasets"}
SHARDS = 16
BATCH = 256
RESULT = "RESULT "
VOCAB, EOS = 50257, 50256  # GPT-2's vocabulary and end-of-text id


def row_fields(row):
    """One row of a structured .npy (fields x, y) as the sample dict: what our engine writes."""
    return {name: row[name] for name in row.dtype.names}


@variable_length("ids")
def token_fields(record):
    """One tokenized document (a Parquet row with a list of ids) as a variable-length field."""
    return {"ids": np.asarray(record["ids"], dtype=np.int32)}


def hf_heavy(record):
    """digits_heavy for datasets.map (same function, same output fields)."""
    from dtrain.preprocess.examples import digits_heavy

    out = digits_heavy(record)
    return {"x": out["x"], "y": out["y"]}


# ---------------------------------------------------------------------------------------------
# The datasets


@dataclass
class Data:
    """One benchmark dataset, the same samples for every format.

    kind "fixed": x [N, ...] and labels y [N]; "tokens": one variable-length int32 sample per document
    (``docs``, a Ragged); "blocks": x [blocks, block size], the documents packed (``docs`` too, which
    our engine packs itself)."""

    label: str
    kind: str
    x: Any = None
    y: Any = None
    docs: Any = None

    def __len__(self) -> int:
        return len(self.docs) if self.kind == "tokens" else len(self.x)

    def sample(self, i: int) -> dict:
        if self.kind == "fixed":
            return {"x": self.x[i], "y": self.y[i]}
        return {"ids": self.x[i] if self.kind == "blocks" else self.docs.rows(i, i + 1).data()}

    def sample_bytes(self) -> int:
        """Bytes of a sample (its mean, for documents)."""
        if self.kind == "tokens":
            return -(-self.docs.values.nbytes // len(self))
        return self.x[0].nbytes + (self.y[0].nbytes if self.y is not None else 0)


def token_documents(n: int, seed: int = 0) -> Ragged:
    """``n`` documents of random ids below GPT-2's vocabulary; lengths log-normal (median 256, sigma 1,
    clipped to 8..8192): most documents short, a few very long, as in web text."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(256), 1.0, n), 8, 8192).astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Ragged(rng.integers(0, EOS, int(offsets[-1]), dtype=np.int32), offsets)


def packed(docs: Ragged, per_shard: int, block: int) -> np.ndarray:
    """What our engine's packing makes of the documents, shard by shard (each shard's tail dropped)."""
    spec = Packing("ids", block, EOS)
    parts = [pack([docs.rows(i, i + 1).data() for i in range(a, min(a + per_shard, len(docs)))],
                  np.dtype(np.int32), spec)[0] for a in range(0, len(docs), per_shard)]
    return np.concatenate(parts)


def write_parquet(docs: Ragged, path: str) -> None:
    """The documents as a Parquet file with one list<int32> column: what a tokenizing job leaves."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    column = pa.ListArray.from_arrays(pa.array(docs.offsets.astype(np.int32)), pa.array(docs.values))
    pq.write_table(pa.table({"ids": column}), path, row_group_size=4096)


# ---------------------------------------------------------------------------------------------
# Writers: each takes a Data (samples in memory) and an empty dir.


def write_dtrain(data: Data, out: str, per_shard: int, scratch: str) -> float:
    from dtrain.preprocess.runner import preprocess

    # The engine reads records from a URL: the samples go in as one structured .npy, or the documents as
    # Parquet (made before the clock starts; reading them back is part of the engine's time).
    if data.kind == "fixed":
        rows = np.empty(len(data), dtype=[("x", data.x.dtype, data.x.shape[1:]), ("y", data.y.dtype)])
        rows["x"], rows["y"] = data.x, data.y
        src, transform, pack_option = os.path.join(scratch, "samples.npy"), ROW_FIELDS, None
        np.save(src, rows)
        del rows
    else:
        src, transform = os.path.join(scratch, "docs.parquet"), TOKEN_FIELDS
        write_parquet(data.docs, src)
        pack_option = {"field": "ids", "block_size": data.x.shape[1], "separator": EOS} if data.kind == "blocks" else None
        per_shard = -(-len(data.docs) // SHARDS)  # documents per shard: packing is per shard
    started = time.perf_counter()
    preprocess([src], out, transform, workers=1, shard_size=per_shard, log=lambda _: None, pack=pack_option)
    return time.perf_counter() - started


def mds_columns(data: Data) -> dict[str, str]:
    if data.kind == "tokens":
        return {"ids": "ndarray:int32"}  # a shape header per sample
    if data.kind == "blocks":
        return {"ids": f"ndarray:int32:{data.x.shape[1]}"}
    shape = ",".join(str(d) for d in data.x.shape[1:])
    return {"x": f"ndarray:{data.x.dtype.name}:{shape}", "y": "int64"}  # fixed dtype and shape: no per-sample header


def write_mds(data: Data, out: str, per_shard: int, scratch: str) -> float:
    streaming = import_streaming()
    started = time.perf_counter()
    with streaming.MDSWriter(out=out, columns=mds_columns(data), size_limit=per_shard * (data.sample_bytes() + 16) + 64,
                             progress_bar=False) as writer:
        for i in range(len(data)):
            writer.write(data.sample(i))
    return time.perf_counter() - started


def write_webdataset(data: Data, out: str, per_shard: int, scratch: str) -> float:
    import webdataset as wds

    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()
    with wds.ShardWriter(os.path.join(out, "shard-%05d.tar"), maxcount=per_shard, verbose=0) as writer:
        for i in range(len(data)):
            sample = data.sample(i)
            members = {"ids.npy": sample["ids"]} if "ids" in sample else {"x.npy": sample["x"], "cls": int(sample["y"])}
            writer.write({"__key__": f"{i:08d}", **members})
    return time.perf_counter() - started


_LIT: dict = {}


def _lit_sample(i: int) -> dict:
    sample = _LIT["data"].sample(i)
    return {"y": int(sample["y"]), "x": sample["x"]} if "y" in sample else sample


def _lit_document(i: int) -> np.ndarray:
    """A document and its end-of-text, for TokensLoader (which cuts the blocks when reading)."""
    return np.append(_LIT["data"].docs.rows(i, i + 1).data(), np.int32(EOS))


def write_litdata(data: Data, out: str, per_shard: int, scratch: str) -> float:
    import litdata

    _LIT.update(data=data)  # the forked optimize worker inherits it
    started = time.perf_counter()
    litdata.optimize(fn=_lit_sample, inputs=list(range(len(data))), output_dir=out, chunk_size=per_shard,
                     num_workers=1, start_method="fork", verbose=False, mode="overwrite")
    return time.perf_counter() - started


def write_litdata_tokens(data: Data, out: str, per_shard: int, scratch: str) -> float:
    """LitData's language-model path (as litgpt prepares data): each document's tokens as one 1-D item,
    chunks of tokens, read back as blocks by TokensLoader."""
    import litdata
    from litdata.streaming.item_loader import TokensLoader

    _LIT.update(data=data)
    started = time.perf_counter()
    litdata.optimize(fn=_lit_document, inputs=list(range(len(data.docs))), output_dir=out,
                     chunk_size=per_shard * data.x.shape[1], item_loader=TokensLoader(), num_workers=1,
                     start_method="fork", verbose=False, mode="overwrite")
    return time.perf_counter() - started


def write_datasets(data: Data, out: str, per_shard: int, scratch: str) -> float:
    """Hugging Face datasets: the documents from the same Parquet file as ours (packed blocks from memory),
    saved to disk as Arrow in 16 shards."""
    datasets = import_datasets()
    if data.kind == "tokens":
        src = os.path.join(scratch, "docs.parquet")
        write_parquet(data.docs, src)
        started = time.perf_counter()
        dataset = datasets.Dataset.from_parquet(src, cache_dir=os.path.join(scratch, "hf-cache"))
    else:
        fixed = getattr(datasets, "List", datasets.Sequence)
        features = datasets.Features({"ids": fixed(datasets.Value("int32"), length=data.x.shape[1])})
        started = time.perf_counter()
        dataset = datasets.Dataset.from_dict({"ids": data.x}, features=features)
    dataset.save_to_disk(out, num_shards=SHARDS)
    return time.perf_counter() - started


WRITERS = {"dtrain": write_dtrain, "mds": write_mds, "webdataset": write_webdataset, "litdata": write_litdata,
           "litdata-tokens": write_litdata_tokens, "datasets": write_datasets}


def import_datasets():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def import_streaming():
    """mosaicml-streaming imports torchvision at package import (for its vision datasets, unused here).
    PyPI's torchvision is built against CUDA torch and fails to import next to the CPU-only torch
    wheel this project installs ("operator torchvision::nms does not exist"); then the vision
    sub-package is left out. MDSWriter and StreamingDataset do not use it."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure of torchvision's native part
        import types

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


# ---------------------------------------------------------------------------------------------
# Readers (run in a child process: `data_formats.py --child read ...`). Each returns
# (iterate_one_epoch(epoch) -> iterator of batches, count(batch) -> (samples, tokens)).
# Variable-length samples come as a list per batch: every library's default collation stacks.


def list_batch(samples: list) -> list:
    return samples


def fields_of(kind: str) -> tuple[str, ...]:
    return ("x", "y") if kind == "fixed" else ("ids",)


def reader_dtrain(directory: str, workers: int, rank: int, world: int, kind: str, mapped: bool = False,
                  collate: str = "list"):
    from dtrain.training.shards import ShardDataset, ShardLoader, ShardSampler

    dataset = ShardDataset(directory, fields=fields_of(kind), **({"cache_bytes": 0} if mapped else {}))  # else defaults
    sampler = ShardSampler(len(dataset), num_replicas=world, rank=rank, seed=0, drop_last=True)
    loader = ShardLoader(dataset, BATCH, sampler, collate=collate)

    def epoch(e):
        sampler.set_epoch(e)
        return iter(loader)
    if kind == "tokens":
        count = ((lambda b: (len(b[0]), sum(len(t) for t in b[0]))) if collate == "list" else
                 (lambda b: (len(b[0].mask), int(b[0].mask.sum()))))
        return epoch, count
    return epoch, (lambda b: (len(b[0]), b[0].numel() if kind == "blocks" else 0))


def count_dicts(kind: str, key: str):
    """Batches of dicts: a list of samples (variable length), or a dict of stacked columns."""
    if kind == "tokens":
        return lambda b: (len(b), sum(len(sample["ids"]) for sample in b))
    if kind == "blocks":
        return lambda b: (len(b["ids"]), b["ids"].numel())
    return lambda b: (len(b[key]), 0)


def reader_mds(directory: str, workers: int, rank: int, world: int, kind: str):
    from torch.utils.data import DataLoader

    streaming = import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory() if world == 1 else None
    dataset = streaming.StreamingDataset(local=directory, shuffle=True, shuffle_seed=0, batch_size=BATCH)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=workers, persistent_workers=workers > 0,
                        collate_fn=list_batch if kind == "tokens" else None)
    return lambda e: iter(loader), count_dicts(kind, "y")  # a new epoch (new shuffle) per iteration


def reader_webdataset(directory: str, workers: int, rank: int, world: int, kind: str):
    import webdataset as wds

    urls = sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".tar"))
    members = ("x.npy", "cls") if kind == "fixed" else ("ids.npy",)
    collation = {"collation_fn": list_batch} if kind == "tokens" else {}
    dataset = (wds.WebDataset(urls, shardshuffle=len(urls), detshuffle=True, seed=0, nodesplitter=wds.split_by_node,
                              empty_check=False)
               .shuffle(1000).decode().to_tuple(*members).batched(BATCH, partial=True, **collation))
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    if kind == "tokens":
        return lambda e: iter(loader), lambda b: (len(b), sum(len(sample[0]) for sample in b))
    return lambda e: iter(loader), lambda b: (len(b[0]), math.prod(b[0].shape) if kind == "blocks" else 0)


def reader_litdata(directory: str, workers: int, rank: int, world: int, kind: str, block: int = 0):
    import litdata

    options = {}
    if block:  # the TokensLoader path: blocks cut from the token stream while reading
        from litdata.streaming.item_loader import TokensLoader

        options = {"item_loader": TokensLoader(block_size=block)}
    dataset = litdata.StreamingDataset(directory, shuffle=True, seed=0, **options)
    loader = litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers,
                                         persistent_workers=workers > 0,
                                         collate_fn=list_batch if kind == "tokens" else None)
    if block:
        return lambda e: iter(loader), lambda b: (len(b), b.numel())
    return lambda e: iter(loader), count_dicts(kind, "y")


def reader_datasets(directory: str, workers: int, rank: int, world: int, kind: str):
    """Arrow on disk through a DataLoader: its batched __getitems__, a DistributedSampler for the rank split."""
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = import_datasets().load_from_disk(directory).with_format("numpy")
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers,
                        persistent_workers=workers > 0, collate_fn=list_batch if kind == "tokens" else None)

    def epoch(e):
        sampler.set_epoch(e)
        return iter(loader)
    return epoch, count_dicts(kind, "ids")


READERS = {"dtrain": reader_dtrain, "dtrain-mapped": lambda *a: reader_dtrain(*a, mapped=True),
           "dtrain-pad": lambda *a: reader_dtrain(*a, collate="pad"), "mds": reader_mds,
           "webdataset": reader_webdataset, "litdata": reader_litdata, "datasets": reader_datasets,
           "litdata-tokens": lambda *a, block: reader_litdata(*a, block=block)}


def child_read(args) -> int:
    """Read `--epochs` epochs (or at least `--seconds` of them); print one RESULT line."""
    import torch

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    import_library(args.format)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
        dist.barrier()
    rss_imported = status_kib()["VmRSS"]
    t0 = time.perf_counter()
    extra = {"block": args.block} if args.format == "litdata-tokens" else {}
    epoch_iter, count = READERS[args.format](args.dir, args.workers, rank, world, args.kind, **extra)
    batches = epoch_iter(0)
    first = next(batches)
    t_first = time.perf_counter()
    wall_first = time.time()
    per_epoch = [count(first)[0]]
    samples, tokens, epoch = 0, 0, 0
    while True:
        for batch in batches:
            n, t = count(batch)
            samples += n
            tokens += t
            per_epoch[-1] += n
        epoch += 1
        done = epoch >= args.epochs if args.epochs else (epoch >= 2 and time.perf_counter() - t_first >= args.seconds)
        if done or epoch >= 500:
            break
        batches = epoch_iter(epoch)
        per_epoch.append(0)
    t_end = time.perf_counter()
    out = {"rank": rank, "ttfb": t_first - t0, "samples": samples, "tokens": tokens, "seconds": t_end - t_first,
           "epochs": epoch,
           "per_epoch": per_epoch[:3], "wall_first": wall_first, "wall_end": time.time(),
           "rss_imported_kib": rss_imported, "hwm_kib": status_kib()["VmHWM"]}
    print(RESULT + json.dumps(out), flush=True)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


def import_library(fmt: str) -> None:
    """Import the reader's library before the clock starts (import time is not time to first batch)."""
    if fmt == "mds":
        import_streaming()
        import streaming.base.util  # noqa: F401
    elif fmt == "webdataset":
        import webdataset  # noqa: F401
    elif fmt.startswith("litdata"):
        import litdata  # noqa: F401
        import litdata.streaming.item_loader  # noqa: F401
    elif fmt == "datasets":
        import_datasets()
    else:  # dtrain, dtrain-mapped, dtrain-pad
        import dtrain.training.shards  # noqa: F401


def status_kib(pid: int | str = "self") -> dict[str, int]:
    values = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    values[key] = int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return values


def private_pss_kib(pid: int) -> int:
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("Pss_Anon", "Pss_Shmem"):
                    total += int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError):
        pass
    return total


# ---------------------------------------------------------------------------------------------
# Driver


class TreeMemory:
    """Peak memory of some processes and all their descendants: RSS polled every 10 ms, private memory
    (proportional set size of anonymous + shared memory, from /proc/PID/smaps_rollup, which costs a
    page-table walk) every 50 ms. PSS splits pages that forked loader workers or ranks share instead
    of counting them once per process, as a sum of RSS does."""

    def __init__(self, pids: list[int]):
        import psutil

        self.roots = [psutil.Process(p) for p in pids]
        self.peak_rss = self.peak_private = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        tick = 0
        while not self._stop.is_set():
            procs = []
            for root in self.roots:
                try:
                    procs += [root, *root.children(recursive=True)]
                except psutil.Error:
                    pass
            self.peak_rss = max(self.peak_rss, sum(status_kib(p.pid).get("VmRSS", 0) for p in procs))
            if tick % 5 == 0:
                self.peak_private = max(self.peak_private, sum(private_pss_kib(p.pid) for p in procs))
            tick += 1
            self._stop.wait(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_read(fmt: str, directory: str, workers: int, world: int, kind: str, epochs: int = 0,
                 seconds: float = 1.0, block: int = 0) -> dict:
    """Start `world` reader processes (ranks), poll their memory, gather their RESULT lines."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "read", "--format", fmt, "--dir", directory,
           "--workers", str(workers), "--epochs", str(epochs), "--seconds", str(seconds), "--kind", kind,
           "--block", str(block)]
    port = free_port()
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    memory = TreeMemory([p.pid for p in procs])
    results, errors = [], []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
            if p.returncode != 0 or not lines:
                errors.append(f"exit {p.returncode}: {(err or out)[-1500:]}")
            else:
                results.append(json.loads(lines[-1][len(RESULT):]))
    finally:
        memory.stop()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    if errors:
        raise RuntimeError(f"{fmt} reader ({world} rank(s), {workers} workers) failed: " + " | ".join(errors))
    samples, tokens = sum(r["samples"] for r in results), sum(r["tokens"] for r in results)
    span = max(r["wall_end"] for r in results) - min(r["wall_first"] for r in results)
    seconds = span if world > 1 else results[0]["seconds"]
    peak_rss = max(memory.peak_rss, sum(r["hwm_kib"] for r in results) if workers == 0 else 0)  # exact peaks too
    return {"rate": samples / seconds, "token_rate": tokens / seconds,
            "ttfb": max(r["ttfb"] for r in results), "epochs": results[0]["epochs"],
            "per_epoch": [sum(r["per_epoch"][i] for r in results) for i in range(min(len(r["per_epoch"])
                                                                                        for r in results))],
            "rss_mb": peak_rss / 1024, "private_mb": memory.peak_private / 1024,
            "imported_mb": sum(r["rss_imported_kib"] for r in results) / 1024}


def warm(path: str) -> None:
    """Flush what the writer left dirty (so write-back does not run during the reads) and read every
    file once: every format is then read from a warm page cache."""
    os.sync()
    for root, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(root, name), "rb") as fh:
                while fh.read(1 << 20):
                    pass


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, n)) for n in names)
    return total


def preprocess_comparison(raw: str, tmp: str, workers: int, rounds: int) -> tuple[dict, float, float]:
    """Our engine vs datasets.map on the same raw JSON lines, alternating, ``rounds`` times each (a fresh output
    and a fresh datasets cache every time); returns (our result, our best s, datasets' best s)."""
    from dtrain.preprocess.runner import preprocess
    from dtrain.training.shards import ShardDataset

    datasets = import_datasets()
    fixed = getattr(datasets, "List", datasets.Sequence)
    features = datasets.Features({"x": fixed(datasets.Value("float32"), length=64), "y": datasets.Value("int64")})
    ours_out = os.path.join(tmp, "digits-preprocessed")
    ours_s = hf_s = float("inf")
    for attempt in range(rounds):
        shutil.rmtree(ours_out, ignore_errors=True)
        started = time.perf_counter()
        result = preprocess([raw], ours_out, HEAVY, workers=workers, shard_size=512, log=lambda _: None)
        ours_s = min(ours_s, time.perf_counter() - started)

        hf_out = os.path.join(tmp, "hf-preprocessed")
        shutil.rmtree(hf_out, ignore_errors=True)
        started = time.perf_counter()
        ds = datasets.load_dataset("json", data_files=raw, split="train",
                                   cache_dir=os.path.join(tmp, f"hf-cache-{attempt}"))
        ds = ds.map(hf_heavy, num_proc=workers, remove_columns=ds.column_names, features=features)
        ds.save_to_disk(hf_out)
        hf_s = min(hf_s, time.perf_counter() - started)
        del ds

    ours = ShardDataset(ours_out, cache_bytes=0)
    theirs = datasets.load_from_disk(os.path.join(tmp, "hf-preprocessed")).with_format("numpy")
    x, y = ours.get_batch(range(len(ours)))
    same = np.array_equal(theirs["x"], x.numpy()) and np.array_equal(theirs["y"], y.numpy())
    if len(theirs) != len(ours) or not same:
        raise RuntimeError("datasets.map and the engine produced different samples: not the same work")
    return result, ours_s, hf_s


def measure(data: Data, formats: tuple[str, ...], tmp: str, seconds: float) -> list[dict]:
    """Write ``data`` with each format, then read it back in every configuration; one row per reading."""
    from dtrain.training.shards import ShardDataset

    n, rows = len(data), []
    per_shard = -(-n // SHARDS)
    block = data.x.shape[1] if data.kind == "blocks" else 0
    for fmt in formats:
        out = os.path.join(tmp, f"{data.label.split()[0]}-{fmt}")
        scratch = os.path.join(tmp, "scratch")
        os.makedirs(scratch, exist_ok=True)
        write_s = WRITERS[fmt](data, out, per_shard, scratch)
        shutil.rmtree(scratch)
        if fmt == "dtrain" and data.kind == "blocks":  # the peers got the blocks our engine's packing makes
            (ids,) = ShardDataset(out, fields=("ids",)).get_batch(range(n))
            if not np.array_equal(ids.numpy(), data.x):
                raise RuntimeError("the engine's packed blocks differ from the ones given to the peers")
        size = dir_bytes(out)
        warm(out)
        variants = [fmt] + (["dtrain-pad"] if fmt == "dtrain" and data.kind == "tokens" else [])
        if fmt == "dtrain" and ShardDataset(out, fields=fields_of(data.kind)).cached:
            variants.append("dtrain-mapped")  # small: also as it reads a dataset above cache_bytes
        configs = [(v, w, world) for v in variants
                   for w, world in [(0, 1)] + ([(2, 1)] if not v.startswith("dtrain") else []) + [(0, 2)]]
        single = {}
        for reader, workers, world in configs:
            if world == 1:
                m = measure_read(reader, out, workers, 1, data.kind, seconds=seconds, block=block)
                single[reader, workers] = m
            else:  # both ranks read the same number of epochs: about --seconds at the 1-reader rate
                epochs = max(2, min(200, round(seconds * single[reader, 0]["rate"] / n)))
                m = measure_read(reader, out, 0, 2, data.kind, epochs=epochs, block=block)
            if m["per_epoch"] and m["per_epoch"][0] < n - 2 * world * BATCH - SHARDS:  # more than drop_last explains
                print(f"warning: {data.label} {reader} read {m['per_epoch'][0]} of {n} samples in its first epoch",
                      file=sys.stderr)
            rows.append({"dataset": data.label, "format": reader, "workers": workers, "world": world,
                         "write_s": write_s, "size_mb": size / 1e6, "n": n, "sample_bytes": data.sample_bytes(), **m})
        shutil.rmtree(out, ignore_errors=True)  # keep the page cache and disk for the next format
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=8, help="copies of the 1437 training digits (records)")
    p.add_argument("--images", type=int, default=16384, help="3x64x64 uint8 image samples (12 KiB each)")
    p.add_argument("--docs", type=int, default=32768, help="token documents (about 420 int32 tokens each)")
    p.add_argument("--block", type=int, default=512, help="tokens per packed block")
    p.add_argument("--only", choices=["all", "text"], default="all", help="text: only the token datasets")
    p.add_argument("--seconds", type=float, default=1.0, help="read at least this long per measurement")
    p.add_argument("--rounds", type=int, default=3, help="preprocessing runs of each side (the best counts)")
    p.add_argument("--child", choices=["read"], help=argparse.SUPPRESS)
    p.add_argument("--format", choices=list(READERS), help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=["fixed", "tokens", "blocks"], default="fixed", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_read(args)

    from dtrain.preprocess.examples import write_digits_jsonl
    from dtrain.training.shards import ShardDataset

    began = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="dtrain-bench-formats-")
    # mosaicml-streaming's StreamingDataset creates <prefix>_barrier_filelock and <prefix>_cache_filelock
    # in the temp folder and never removes them (streaming/base/dataset.py, 0.13): the reader processes
    # get a temp folder inside tmp, removed with it.
    os.makedirs(os.path.join(tmp, "tmp"))
    os.environ["TMPDIR"] = os.path.join(tmp, "tmp")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        fixed_sets, lines = [], []
        if args.only == "all":
            raw = write_digits_jsonl(os.path.join(tmp, "raw"), partitions=1, repeat=args.repeat)[0]
            result, ours_s, hf_s = preprocess_comparison(raw, tmp, workers=2, rounds=args.rounds)
            n_records = result["records"]
            lines.append(f"preprocess digits_heavy, {n_records} records JSON lines -> on disk, 2 processes, best of "
                         f"{args.rounds}: dtrain engine {n_records / ours_s:.0f} records/s ({ours_s:.1f} s) | "
                         f"datasets.map(num_proc=2) + save_to_disk {n_records / hf_s:.0f} records/s ({hf_s:.1f} s) | "
                         f"ratio {hf_s / ours_s:.2f}x")
            digits = ShardDataset(os.path.join(tmp, "digits-preprocessed"), cache_bytes=0)
            dx, dy = (t.numpy() for t in digits.get_batch(range(len(digits))))
            rng = np.random.default_rng(0)
            ix = rng.integers(0, 256, size=(args.images, 3, 64, 64), dtype=np.uint8)
            iy = rng.integers(0, 1000, size=args.images).astype(np.int64)
            fixed_sets = [Data("digits_heavy", "fixed", dx, dy), Data("images 3x64x64", "fixed", ix, iy)]
        docs = token_documents(args.docs)
        text_sets = [Data("tokens unpacked", "tokens", docs=docs),
                     Data("tokens packed", "blocks", x=packed(docs, -(-args.docs // SHARDS), args.block), docs=docs)]

        fixed_rows = [r for data in fixed_sets for r in measure(data, FORMATS, tmp, args.seconds)]
        text_rows = [r for data in text_sets for r in measure(
            data, TEXT_FORMATS + (("litdata-tokens",) if data.kind == "blocks" else ()), tmp, args.seconds)]
        if fixed_rows:
            print_table(fixed_rows)
        print_table(text_rows, tokens=True)
        for data in fixed_sets:
            print(reader_line(data.label, [r for r in fixed_rows if r["dataset"] == data.label]))
        for data in text_sets:
            print(reader_line(data.label, [r for r in text_rows if r["dataset"] == data.label], tokens=True))
        for line in lines:
            print(line)
        print(f"(benchmark wall time {time.perf_counter() - began:.0f} s)", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def config_name(r: dict) -> str:
    return NAMES[r["format"]] + (f", {r['workers']} workers" if r["workers"] else "")


def print_table(rows: list[dict], tokens: bool = False) -> None:
    """One line per format and loader-worker count; with ``tokens``, tokens/s after samples/s."""
    rate, dash = (f"{'tokens/s':>10} " if tokens else ""), "-"
    head = (f"{'dataset':<15} {'format, loader workers':<28} {'write s':>7} {'MB':>7} | {'1 reader':>10} {rate}"
            f"{'1st batch':>9} {'RSS MB':>7} {'private':>7} | {'2 ranks':>10} {rate}{'1st batch':>9} {'RSS MB':>7} "
            f"{'private':>7}")
    print(head)
    print("-" * len(head))
    by = {}
    for r in rows:
        by.setdefault((r["dataset"], r["format"], r["workers"]), {})[r["world"]] = r
    for (dataset, fmt, workers), worlds in by.items():
        one, two = worlds.get(1), worlds.get(2)
        first = one or two

        def cols(m):
            if m is None:
                return f"{'-':>10} {rate and f'{dash:>10} '}{'-':>9} {'-':>7} {'-':>7}"
            token_col = f"{m['token_rate']:>10.0f} " if tokens else ""
            return f"{m['rate']:>10.0f} {token_col}{m['ttfb']:>9.3f} {m['rss_mb']:>7.0f} {m['private_mb']:>7.0f}"
        print(f"{dataset:<15} {config_name(first):<28} {first['write_s']:>7.2f} {first['size_mb']:>7.1f} | "
              f"{cols(one)} | {cols(two)}")
    print(f"(samples/s{', tokens/s' if tokens else ''}, aggregate over ranks; 1st batch: seconds from constructing the "
          "dataset and loader to the first batch; RSS and private (PSS of anonymous + shared memory) MB: peak of the "
          "reading processes, ranks and loader workers together; write: one process, dtrain's fsyncs every file, the "
          "others do not)")


def reader_line(label: str, rows: list[dict], tokens: bool = False) -> str:
    """dtrain (as a training script gets it by default) against the fastest and the leanest peer."""
    key, unit = ("token_rate", "tokens/s") if tokens else ("rate", "samples/s")
    ours = {r["world"]: r for r in rows if r["format"] == "dtrain"}
    parts = []
    for world, what in ((1, "1 reader"), (2, "2 ranks")):
        peers = [r for r in rows if not r["format"].startswith("dtrain") and r["world"] == world]
        peer = max(peers, key=lambda r: r[key])
        mem = min(peers, key=lambda r: r["private_mb"])
        fastest_mem = f" (fastest peer {peer['private_mb']:.0f} MB)" if tokens else ""
        parts.append(f"{what}: dtrain {ours[world][key]:.0f} {unit} vs best peer {config_name(peer)} "
                     f"{peer[key]:.0f}, ratio {ours[world][key] / peer[key]:.2f}x; private memory "
                     f"dtrain {ours[world]['private_mb']:.0f} MB vs leanest peer {config_name(mem)} "
                     f"{mem['private_mb']:.0f} MB{fastest_mem}")
    n, b = rows[0]["n"], rows[0]["sample_bytes"]
    size = f"{n} samples x {b} B" if not tokens else f"{n} samples, {b} B on average"
    return f"read {label} ({size}, batch {BATCH}): " + " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
