"""The training stall per checkpoint, and the load time: rank-0 torch.save vs DCP synchronous vs DCP
asynchronous, to the shared filesystem and to object storage (moto's S3 server on loopback).

A 2 node x 2 process gloo job (``dtrain launch``, the local backend) trains an FSDP2 model of
``--params-gib`` of float32 parameters (Linear 4096x4096 layers) with Adam (twice as much state again)
and checkpoints it each way (bench/scripts/checkpoint_rank.py says how each is timed). One line each
with the ratio to rank-0 torch.save, then the asynchronous stall against the synchronous one (the
goal: at most 10%).

    .venv/bin/python bench/checkpoint.py [--params-gib 1.0] [--only fs|s3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
RANK = os.path.join(REPO, "bench", "scripts", "checkpoint_rank.py")


def run_job(location: str, params_gib: float, env: dict[str, str], work: str) -> dict:
    out = os.path.join(work, "result.json")
    argv = [os.path.join(BIN, "dtrain"), "launch", "--nodes", "2", "--procs-per-node", "2", "--device", "cpu",
            "--run-dir", os.path.join(work, "run"), "--", sys.executable, RANK, "--location", location,
            "--params-gib", str(params_gib), "--out", out]
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"the job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(out, encoding="utf-8") as fh:
        return json.load(fh)


def moto(work: str) -> tuple[object, dict[str, str]]:
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    import boto3

    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1", aws_access_key_id="bench",
                 aws_secret_access_key="bench").create_bucket(Bucket="dtrain-bench")
    return server, env


def report(where: str, found: dict) -> None:
    results = found["results"]
    size = f"{found['params'] * 4 / (1 << 30):.2f} GiB params + {found['params'] * 8 / (1 << 30):.2f} GiB Adam state"
    base = results["torch.save"]
    for name, label in (("torch.save", "rank-0 torch.save"), ("dcp-sync", "DCP synchronous"),
                        ("dcp-async", "DCP asynchronous")):
        r = results[name]
        extra = f", committed after {r['committed_s']:.2f} s" if name == "dcp-async" else ""
        print(f"checkpoint {where} {label}: stall {r['stall_s']:.2f} s ({r['stall_s'] / base['stall_s']:.3f}x "
              f"torch.save {base['stall_s']:.2f} s){extra}; load {r['load_s']:.2f} s "
              f"({r['load_s'] / base['load_s']:.3f}x torch.save {base['load_s']:.2f} s) "
              f"[2x2 gloo FSDP2, {size}]", flush=True)
    sync, asyn = results["dcp-sync"]["stall_s"], results["dcp-async"]["stall_s"]
    print(f"checkpoint {where} DCP async vs sync stall: {asyn:.2f} s vs {sync:.2f} s = {asyn / sync:.3f} "
          f"(goal <= 0.10: {'met' if asyn <= 0.1 * sync else 'NOT met'})", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--params-gib", type=float, default=1.0)
    p.add_argument("--only", choices=("fs", "s3"))
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="dtrain-bench-ckpt-")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = None
    try:
        if args.only in (None, "fs"):
            report("shared-fs", run_job(os.path.join(work, "shared", "ckpt"), args.params_gib, env, work))
            shutil.rmtree(os.path.join(work, "shared"), ignore_errors=True)
        if args.only in (None, "s3"):
            server, aws = moto(work)
            report("moto-s3", run_job("s3://dtrain-bench/ckpt", args.params_gib, {**env, **aws}, work))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
