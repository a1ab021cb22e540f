"""``dtrain preprocess --transform MOD:FN --input URL --output DIR``: preprocess into shards from a shell.

Every ``--input`` is one partition (processed over ``--workers`` processes), then the
dataset is finalized: quarantine.jsonl merged, the bad-record fraction checked, and
manifest.json written last. Exit status 0 when published, 2 on bad arguments or too many
bad records (nothing published). ``--transform`` names code that is imported and run, as
``python -m`` would: the user must trust it.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "preprocess", help="preprocess raw records into training-ready shards",
        description="Apply a transform to raw records (JSON lines, CSV, Parquet, .npy under any fsspec URL) "
                    "and write memory-mappable shards plus manifest.json.")
    p.add_argument("--transform", required=True, metavar="MOD:FN",
                   help="import path of the transform: one parsed record in, a dict of arrays (or None) out. "
                        "It is imported and run in this process and its workers, as `python -m` runs a module: "
                        "name only code you trust")
    p.add_argument("--input", required=True, action="append", metavar="URL",
                   help="a file, directory or glob (repeat for more partitions)")
    p.add_argument("--output", required=True, metavar="DIR", help="dataset directory or URL")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="processes (default: every core)")
    p.add_argument("--max-bad-fraction", type=float, default=0.001, metavar="F",
                   help="fail, publishing nothing, above this fraction of bad records (default 0.001)")
    p.add_argument("--shard-size", type=int, default=8192, metavar="RECORDS", help="input records per shard")
    # Text, checked by the engine's own rule: a refusal names the field, the value and what is allowed.
    p.add_argument("--max-record-bytes", default=None, metavar="BYTES",
                   help="largest input record (a line, a .npy row) read, default 67108864 (64 MiB); a longer line "
                        "is quarantined as a bad record without being read into memory (a decompression bomb)")
    p.add_argument("--pack", default=None, metavar="FIELD",
                   help="pack the transform's variable-length token field FIELD: each shard's sequences end to end, "
                        "each followed by --separator, cut into --block-size tokens (causal-LM training)")
    p.add_argument("--block-size", type=int, default=None, metavar="TOKENS", help="tokens per packed block")
    p.add_argument("--separator", type=int, default=None, metavar="ID",
                   help="token id put after every sequence when packing, e.g. end-of-text (default: none)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dtrain.preprocess.inputs import DEFAULT_MAX_RECORD_BYTES
    from dtrain.preprocess.runner import coerce_max_record_bytes, preprocess

    limit = DEFAULT_MAX_RECORD_BYTES
    if args.max_record_bytes is not None:
        limit = coerce_max_record_bytes(args.max_record_bytes)
    pack = None
    if args.pack is not None or args.block_size is not None or args.separator is not None:
        pack = {"field": args.pack, "block_size": args.block_size, "separator": args.separator}  # checked by the engine
    result = preprocess(args.input, args.output, args.transform, workers=args.workers,
                        shard_size=args.shard_size, max_bad_fraction=args.max_bad_fraction, max_record_bytes=limit,
                        pack=pack)
    print(f"[preprocess] {result['num_samples']} samples, {result['shards']} shards, "
          f"{result['bad_records']} bad -> {result['manifest']}")
    return 0
