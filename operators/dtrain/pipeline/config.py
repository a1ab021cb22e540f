"""Where the retraining pipeline reads and writes, from the environment (read at parse time: no I/O).

Every path a run touches is keyed by dataset version and data-interval partition, so a
retry resumes from its own checkpoint, backfills and concurrent runs never write into
each other, and a rerun of one date leaves the others untouched. Checkpoints are further
keyed by the run's clear number: a cleared (rerun) run trains afresh, a retry resumes.

| variable | default | meaning |
|---|---|---|
| DTRAIN_RAW_URL | s3://dtrain-demo/raw | raw records: <raw>/<version>/<partition>/*.jsonl |
| DTRAIN_PROCESSED_URL | s3://dtrain-demo/processed | preprocessed shards, same keys |
| DTRAIN_SHARED_FS | $DTRAIN_HOME/shared | the shared filesystem every node reads (an FSx mount) |
| DTRAIN_MODELS | <shared>/models | published models: <models>/<pipeline>/<version>/<partition>/ |
| DTRAIN_AWS_CONN_ID | aws_default | Airflow connection with the object-store credentials |
| DTRAIN_RETRAIN_SCHEDULE | @daily | the DAG's schedule ("none" for manual only) |
| DTRAIN_RETRAIN_CATCHUP | false | let the scheduler run missed intervals |
| DTRAIN_RETRAIN_START_DATE | 2026-01-01 | the schedule's first interval (backfills may go earlier) |
| DTRAIN_SSH_CONN_ID | dtrain_ssh | hosts for backend=ssh |
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass

from dtrain.paths import dtrain_home


@dataclass(frozen=True)
class PipelineConfig:
    raw_url: str
    processed_url: str
    shared_fs: str
    models_root: str
    aws_conn_id: str
    schedule: str | None
    catchup: bool
    ssh_conn_id: str
    start_date: dt.datetime


def load_config(environ: dict[str, str] | None = None) -> PipelineConfig:
    env = os.environ if environ is None else environ
    shared = env.get("DTRAIN_SHARED_FS") or os.path.join(dtrain_home(), "shared")
    schedule = env.get("DTRAIN_RETRAIN_SCHEDULE", "@daily").strip()
    return PipelineConfig(
        raw_url=env.get("DTRAIN_RAW_URL", "s3://dtrain-demo/raw").rstrip("/"),
        processed_url=env.get("DTRAIN_PROCESSED_URL", "s3://dtrain-demo/processed").rstrip("/"),
        shared_fs=shared,
        models_root=env.get("DTRAIN_MODELS") or os.path.join(shared, "models"),
        aws_conn_id=env.get("DTRAIN_AWS_CONN_ID", "aws_default"),
        schedule=None if schedule.lower() in ("", "none", "null") else schedule,
        catchup=env.get("DTRAIN_RETRAIN_CATCHUP", "false").strip().lower() in ("1", "true", "yes"),
        ssh_conn_id=env.get("DTRAIN_SSH_CONN_ID", "dtrain_ssh"),
        start_date=dt.datetime.fromisoformat(env.get("DTRAIN_RETRAIN_START_DATE", "2026-01-01")).replace(
            tzinfo=dt.timezone.utc),
    )


def partition_of(dag_run) -> str:
    """The run's data-interval partition: its logical date (YYYY-MM-DD), or for a manual run
    without one, the date it was triggered for."""
    when = getattr(dag_run, "logical_date", None) or getattr(dag_run, "data_interval_start", None) \
        or getattr(dag_run, "run_after", None)
    return when.strftime("%Y-%m-%d")
