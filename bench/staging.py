"""Benchmark: `dtrain stage` vs s5cmd vs `aws s3 cp --recursive`, same data, same moto server.

Data: 4 x 64 MiB objects (uploaded multipart, 8 MiB parts, as the AWS CLI does) and
300 x 256 KiB objects, served by moto's S3 server on loopback. The three tools run
alternately (order rotated each round) into fresh directories; the median of the
rounds is reported. dtrain runs with its defaults (every file verified and made durable
before its rename) and once more with --no-fsync, since s5cmd and the AWS CLI do not
fsync. Credentials come from the environment, so dtrain uses its lean S3 client; it runs
once more through botocore (DTRAIN_S3_CLIENT=botocore), the path a profile or an instance
role takes. Every tool's output is checked for completeness, so no tool wins
by copying less. Then 2,000 small objects are staged once and re-staged unchanged
(median of 3): that re-stage time is the incremental cost.

Prints ONE line. Run: .venv/bin/python bench/staging.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from timing import timed  # bench/ is on sys.path when a benchmark runs as a script

BIN = os.path.dirname(os.path.abspath(sys.executable))
MiB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def upload(client, bucket: str, prefix: str, big: int, small: int, small_size: int) -> tuple[int, int]:
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB)
    total = 0
    items = [(f"{prefix}big/{i:02d}.bin", 64 * MiB) for i in range(big)]
    items += [(f"{prefix}small/{i // 100:02d}/{i:04d}.bin", small_size) for i in range(small)]

    def put(item):
        key, size = item
        client.upload_fileobj(io.BytesIO(os.urandom(size)), bucket, key, Config=config)
        return size

    with ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(put, items))
    return len(items), total


def tree_size(path: str) -> tuple[int, int]:
    count = size = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            if name.startswith(".dtrain-"):
                continue
            count += 1
            size += os.path.getsize(os.path.join(root, name))
    return count, size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--big", type=int, default=4)
    ap.add_argument("--small", type=int, default=300)
    ap.add_argument("--unchanged", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=None, help="dtrain --workers (default: its own default)")
    args = ap.parse_args()

    from moto.server import ThreadedMotoServer
    import logging
    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    work = tempfile.mkdtemp(prefix="dtrain-bench-")
    env = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=endpoint, AWS_EC2_METADATA_DISABLED="true")
    env.pop("AWS_PROFILE", None)
    try:
        import boto3
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                              region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        count, total = upload(client, "bench", "data/", args.big, args.small, 256 * 1024)
        tools = {
            "dtrain": lambda d: [f"{BIN}/dtrain", "stage", "s3://bench/data/", d, "--progress-interval", "0"]
                                + (["--workers", str(args.workers)] if args.workers else []),
            "dtrain-nofsync": lambda d: [f"{BIN}/dtrain", "stage", "s3://bench/data/", d, "--progress-interval", "0",
                                         "--no-fsync"] + (["--workers", str(args.workers)] if args.workers else []),
            "dtrain-botocore": lambda d: [f"{BIN}/dtrain", "stage", "s3://bench/data/", d, "--progress-interval", "0"]
                                          + (["--workers", str(args.workers)] if args.workers else []),
            "s5cmd": lambda d: [f"{BIN}/s5cmd", "--endpoint-url", endpoint, "cp", "s3://bench/data/*", d + "/"],
            "aws": lambda d: [f"{BIN}/aws", "--endpoint-url", endpoint, "s3", "cp", "--recursive", "--quiet",
                              "s3://bench/data/", d],
        }
        times: dict[str, list[float]] = {name: [] for name in tools}
        names = list(tools)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                dest = os.path.join(work, f"{name}-{r}")
                tool_env = {**env, "DTRAIN_S3_CLIENT": "botocore"} if name == "dtrain-botocore" else env
                times[name].append(timed(tools[name](dest), tool_env))
                got = tree_size(dest)
                if got != (count, total):
                    raise SystemExit(f"{name} copied {got}, expected {(count, total)}")
                shutil.rmtree(dest)
        med = {name: statistics.median(t) for name, t in times.items()}

        # Incremental: 2,000 unchanged objects re-staged.
        def put_small(i):
            client.put_object(Bucket="bench", Key=f"many/{i // 200:02d}/{i:05d}.bin", Body=os.urandom(1024))
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put_small, range(args.unchanged)))
        dest = os.path.join(work, "many")
        argv = [f"{BIN}/dtrain", "stage", "s3://bench/many/", dest, "--progress-interval", "0"]
        first = timed(argv, env)
        again = statistics.median(timed(argv, env) for _ in range(3))
        if tree_size(dest)[0] != args.unchanged:
            raise SystemExit("incremental destination incomplete")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"staging {count} objects ({args.big}x64MiB + {args.small}x256KiB = {total / MiB:.0f} MiB) from moto S3 on "
          f"loopback, median of {args.rounds}: dtrain {med['dtrain']:.2f} s, s5cmd {med['s5cmd']:.2f} s, "
          f"aws s3 cp {med['aws']:.2f} s; dtrain/s5cmd {med['dtrain'] / med['s5cmd']:.2f}, "
          f"dtrain/aws {med['dtrain'] / med['aws']:.2f} (dtrain --no-fsync {med['dtrain-nofsync']:.2f} s, "
          f"/s5cmd {med['dtrain-nofsync'] / med['s5cmd']:.2f}; s5cmd and aws do not fsync; dtrain through "
          f"botocore, as with a profile or instance role, {med['dtrain-botocore']:.2f} s, "
          f"/s5cmd {med['dtrain-botocore'] / med['s5cmd']:.2f}); "
          f"re-stage {args.unchanged} unchanged objects: "
          f"{again:.2f} s (first stage {first:.2f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
