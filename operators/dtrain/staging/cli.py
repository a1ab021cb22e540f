"""``dtrain stage SRC DST`` and ``dtrain plan``.

``stage`` honours the standard AWS environment (AWS_ENDPOINT_URL, AWS_PROFILE,
AWS_ACCESS_KEY_ID, ...): s3fs/botocore read it. ``--storage-options`` passes extra
fsspec options as JSON, or ``@FILE`` to read them from a file so that secrets stay
out of argv (which any local user can read in /proc).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys


def register(subparsers) -> None:
    from dtrain.staging.engine import DEFAULT_PART_SIZE, DEFAULT_WORKERS

    p = subparsers.add_parser("stage", help="mirror an object-store prefix onto the shared filesystem",
                              description="Copy every object under SRC into DST (relative paths kept), "
                                          "incrementally, verified, atomically; manifest written last.")
    p.add_argument("source", metavar="SRC", help="s3://bucket/prefix/, file:// or memory:// URL, or a local path")
    p.add_argument("destination", metavar="DST", help="directory on the shared filesystem (or an fsspec URL)")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                   help=f"parallel requests (files and parts of large files; default {DEFAULT_WORKERS})")
    p.add_argument("--part-size", default=str(DEFAULT_PART_SIZE),
                   help="ranged-part size for large objects, e.g. 64MiB (default 64MiB; memory per worker stays 8 MiB)")
    p.add_argument("--delete", action="store_true", help="remove files no longer in the source")
    p.add_argument("--verify", default="auto", choices=("auto", "strict", "size"),
                   help="auto: MD5 vs single-part ETags, stored full-object checksums or recomputed "
                        "multipart ETags (part size from HEAD ?partNumber=1), else size + fingerprint; "
                        "strict: the same as auto (kept for compatibility); "
                        "size: size only (e.g. SSE-KMS objects, whose ETag is no MD5)")
    p.add_argument("--storage-options", metavar="JSON|@FILE", help="fsspec storage options for the source")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync per file (faster; less durable on crash)")
    p.add_argument("--progress-interval", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--epoch-seconds", type=float, help="target epoch time: compare staging throughput with the need")
    p.add_argument("--nodes", default=1, help="training nodes (with --epoch-seconds)")
    p.add_argument("--deployment-type", help="FSx for Lustre deployment type to size (with --epoch-seconds)")
    p.add_argument("--fail-below-need", action="store_true",
                   help="exit non-zero if staging throughput is below what training needs")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=run_stage)

    q = subparsers.add_parser("plan", help="read throughput training needs and the FSx for Lustre size that gives it")
    q.add_argument("--dataset-size", required=True, help="e.g. 100GB, 1.5TiB or bytes")
    q.add_argument("--epoch-seconds", required=True, type=float, help="target seconds per epoch")
    q.add_argument("--nodes", default=1, help="training nodes (default 1)")
    q.add_argument("--deployment-type", help="only this FSx for Lustre deployment type (default: all)")
    q.add_argument("--table", metavar="FILE", help="JSON deployment-type table overriding the built-in one")
    q.add_argument("--json", action="store_true", help="print the plan as JSON")
    q.set_defaults(func=run_plan)


def storage_options_arg(value: str | None) -> dict:
    from dtrain.args import read_input_file
    from dtrain.errors import SpecError

    if not value:
        return {}
    text = read_input_file("--storage-options", value[1:]) if value.startswith("@") else value
    try:
        options = json.loads(text)
    except ValueError as e:
        # Never echo the text: it may hold a secret.
        raise SpecError("--storage-options", "<not shown>", "a JSON object, or @FILE holding one") from e
    if not isinstance(options, dict):
        raise SpecError("--storage-options", "<not shown>", "a JSON object, or @FILE holding one")
    return options


def run_stage(args: argparse.Namespace) -> int:
    import threading

    from dtrain.staging.engine import stage
    from dtrain.staging.planner import plan, verdict

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    for noisy in ("botocore", "aiobotocore", "s3fs", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    options = storage_options_arg(args.storage_options)
    cancel = threading.Event()

    def on_signal(signum, _frame):
        print(f"[dtrain] received signal {signum}: cancelling the stage", file=sys.stderr, flush=True)
        cancel.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    result = stage(args.source, args.destination, workers=args.workers, part_size=args.part_size,
                   delete=args.delete, storage_options=options, verify=args.verify,
                   progress_interval=args.progress_interval, fsync=not args.no_fsync, cancel=cancel,
                   log=logging.getLogger("dtrain.staging"))
    out = result.to_dict()
    if args.epoch_seconds:
        p = plan(result.bytes_total, args.epoch_seconds, args.nodes, args.deployment_type)
        out["throughput"] = verdict(p, result.mb_per_s, fail=False)
        logging.getLogger("dtrain.staging").log(
            logging.INFO if out["throughput"]["ok"] is not False else logging.WARNING,
            "%s", out["throughput"]["message"])
    if args.json:
        print(json.dumps(out, indent=1))
    if args.epoch_seconds and args.fail_below_need and out["throughput"]["ok"] is False:
        return 3
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from dtrain.staging.planner import plan

    p = plan(args.dataset_size, args.epoch_seconds, args.nodes, args.deployment_type, args.table)
    if args.json:
        print(json.dumps(p.to_dict(), indent=1))
    else:
        print("\n".join(p.lines()))
    return 0
