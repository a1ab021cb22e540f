"""Run retrain_pipeline end to end on the local machine with embedded stand-ins for the cloud.

    python -m dtrain.pipeline.demo [--date 2026-01-01 ...] [--nodes 2 --procs-per-node 2 --epochs 20]

What stands in for what (all real software, on loopback):
  * S3  -> moto's S3 server, seeded with raw digits records under s3://dtrain-demo/raw/<version>/<date>/;
  * FSx -> a directory (``DTRAIN_SHARED_FS``, default ``$DTRAIN_HOME/shared``);
  * GPU nodes -> the local backend (2 simulated nodes x 2 processes, gloo on CPU).
Credentials reach the pipeline as the Airflow connection ``aws_default`` (an environment
variable of the ``airflow`` process), never in argv or logs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from typing import Iterator

BUCKET = "dtrain-demo"
DEMO_KEY = {"key": "demo-access-key", "secret": "demo-secret-key"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """moto's S3 server on a free loopback port; yields its endpoint URL."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per S3 request on the console
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=DEMO_KEY["key"], aws_secret_access_key=DEMO_KEY["secret"])


def seed_raw(endpoint: str, dates: list[str], version: str = "v1", parts: int = 2) -> int:
    """Upload the reference split's training records, in ``parts`` JSON-lines files per date."""
    from dtrain.preprocess.examples import digits_records

    records = digits_records(split="train")
    client = s3_client(endpoint)
    try:
        client.create_bucket(Bucket=BUCKET)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    for date in dates:
        for part in range(parts):
            body = "".join(json.dumps(r) + "\n" for r in records[part::parts])
            client.put_object(Bucket=BUCKET, Key=f"raw/{version}/{date}/part-{part}.jsonl", Body=body.encode())
    return len(records)


def airflow_env(endpoint: str) -> dict[str, str]:
    conn = {"conn_type": "aws", "login": DEMO_KEY["key"], "password": DEMO_KEY["secret"],
            "extra": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    env = dict(os.environ)
    env["AIRFLOW_CONN_AWS_DEFAULT"] = json.dumps(conn)
    env.setdefault("DTRAIN_RAW_URL", f"s3://{BUCKET}/raw")
    env.setdefault("DTRAIN_PROCESSED_URL", f"s3://{BUCKET}/processed")
    # The S3 credentials are in the connection only, never ambient variables: each task that needs them
    # (the training ranks too, through the train task's aws_conn_id) gets them from it.
    return env


def _clean(line: str) -> str:
    """A task-log line without Airflow's timestamp, level and logger suffix."""
    line = re.sub(r"\s+\[airflow\.[^\]]*\].*$", "", line)
    return re.sub(r"^\S+Z \[\w+\s*\] ", "", line).strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--date", action="append", help="logical date(s) to run (default: 2026-01-01)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--procs-per-node", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--distribution", default="pytorch", choices=("pytorch", "deepspeed"))
    args = p.parse_args(argv)
    dates = args.date or ["2026-01-01"]
    airflow = os.path.join(os.path.dirname(sys.executable), "airflow")
    conf = json.dumps({"nodes": args.nodes, "procs_per_node": args.procs_per_node, "epochs": args.epochs,
                       "distribution": args.distribution})
    with moto_s3() as endpoint:
        count = seed_raw(endpoint, dates)
        print(f"demo: moto S3 at {endpoint}, seeded {count} raw records per date for {', '.join(dates)}", flush=True)
        env = airflow_env(endpoint)
        for date in dates:
            proc = subprocess.run([airflow, "dags", "test", "retrain_pipeline", date, "--conf", conf],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            lines = proc.stdout.splitlines()
            wanted = [line for line in lines if "PUBLISHED model" in line or "evaluate: {" in line
                      or "gate: " in line or "global_batch=" in line
                      or "failed" in line.lower() and "state" in line.lower()]
            for line in wanted:
                print("  " + _clean(line))
            if proc.returncode != 0 or not any("PUBLISHED model" in line for line in lines):
                print("\n".join(lines[-80:]))
                print(f"demo: retrain_pipeline failed for {date}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
