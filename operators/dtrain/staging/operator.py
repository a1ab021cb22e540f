"""StageToSharedFSOperator: a thin Airflow operator over the staging engine.

Parse time stays cheap: only ``airflow.sdk`` is imported here; the engine (and, through
fsspec, s3fs/botocore) is imported inside ``execute``. ``__init__`` stores arguments and
does no I/O. Credentials come from an Airflow AWS connection (read by dtrain.hooks.aws) and
reach s3fs as storage options only: never argv, never the log, never XCom.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

from airflow.sdk import BaseOperator


class StageToSharedFSOperator(BaseOperator):
    """Mirror ``source`` into ``destination/<dataset_version>`` on the shared filesystem.

    Args:
        source: object-store URL, e.g. ``s3://bucket/train/{{ ds }}/`` (templated).
        destination: root directory on the shared filesystem (templated).
        dataset_version: subdirectory the data lands in (templated; default ``{{ ds }}``, the
            logical date), so backfills and concurrent runs never share a half-written directory.
            Must be one path component. Set to ``""`` to write into ``destination`` itself.
        aws_conn_id: Airflow AWS connection with the credentials (login = access key id, password =
            secret key, extra: ``endpoint_url``, ``region_name``, ``aws_session_token``,
            ``profile_name``; ``role_arn`` with the amazon provider installed: dtrain.hooks.aws).
            ``None``: the worker's ambient AWS environment.
        storage_options: extra non-secret fsspec options for the source (templated).
        workers, part_size, delete, verify: as in :func:`dtrain.staging.engine.stage`.
        epoch_seconds, nodes, deployment_type, fsx_table: when ``epoch_seconds`` is set, the
            planner compares the measured staging throughput with what training needs.
        fail_below_need: fail the task (instead of a warning) when staging throughput is below
            the need.

    XCom (return value): destination, manifest_path, files_total, fetched, skipped, deleted,
    gone_count, bytes_total, bytes_fetched, seconds, mb_per_s and ``throughput`` (the planner's
    verdict, or None).
    """

    template_fields: Sequence[str] = ("source", "destination", "dataset_version", "storage_options",
                                      "workers", "epoch_seconds", "nodes", "deployment_type")
    template_fields_renderers = {"storage_options": "json"}
    ui_color = "#e8f4e4"

    def __init__(self, *, source: str, destination: str, dataset_version: str | None = "{{ ds }}",
                 aws_conn_id: str | None = "aws_default", storage_options: dict[str, Any] | None = None,
                 workers: int | str = 32, part_size: int | str = "64MiB", delete: bool = False,
                 verify: str = "auto", epoch_seconds: float | str | None = None, nodes: int | str = 1,
                 deployment_type: str | None = None, fsx_table: dict | None = None,
                 fail_below_need: bool = False, progress_interval: float = 30.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source = source
        self.destination = destination
        self.dataset_version = dataset_version
        self.aws_conn_id = aws_conn_id
        self.storage_options = storage_options
        self.workers = workers
        self.part_size = part_size
        self.delete = delete
        self.verify = verify
        self.epoch_seconds = epoch_seconds
        self.nodes = nodes
        self.deployment_type = deployment_type
        self.fsx_table = fsx_table
        self.fail_below_need = fail_below_need
        self.progress_interval = progress_interval
        self._cancel = threading.Event()

    def resolved_destination(self) -> str:
        """``destination/dataset_version``, refusing a version that is not one plain path component."""
        from dtrain.errors import SpecError

        version = "" if self.dataset_version is None else str(self.dataset_version).strip()
        if not version:
            return self.destination
        if "/" in version or "\\" in version or version in (".", "..") or "\x00" in version:
            raise SpecError("dataset_version", version, "one path component (no '/', not '.' or '..')")
        if "://" in self.destination:
            return self.destination.rstrip("/") + "/" + version
        return os.path.join(self.destination, version)

    def storage_options_for_source(self) -> dict[str, Any]:
        """fsspec options: the user's (non-secret) ones plus the connection's credentials."""
        from dtrain.args import mapping_arg

        options = dict(mapping_arg("storage_options", self.storage_options or {}, not_json="a JSON object",
                                   not_mapping="a mapping of fsspec options", secret=True))
        if self.aws_conn_id and str(self.source).startswith(("s3://", "s3a://")):
            from dtrain.hooks.aws import aws_storage_options

            conn_options = aws_storage_options(self.aws_conn_id, self.log)
            client_kwargs = {**(options.get("client_kwargs") or {}), **conn_options.pop("client_kwargs", {})}
            options.update(conn_options)
            if client_kwargs:
                options["client_kwargs"] = client_kwargs
        return options

    def execute(self, context: Any) -> dict[str, Any]:
        from dtrain.staging.engine import stage
        from dtrain.staging.planner import plan, verdict

        destination = self.resolved_destination()
        options = self.storage_options_for_source()
        result = stage(self.source, destination, workers=self.workers, part_size=self.part_size,
                       delete=bool(self.delete), storage_options=options, verify=self.verify,
                       progress_interval=self.progress_interval, log=self.log, cancel=self._cancel)
        out = result.to_dict()
        out["throughput"] = None
        if self.epoch_seconds not in (None, ""):
            p = plan(result.bytes_total, self.epoch_seconds, self.nodes, self.deployment_type, self.fsx_table)
            out["throughput"] = verdict(p, result.mb_per_s, fail=bool(self.fail_below_need))
            level = self.log.info if out["throughput"]["ok"] is not False else self.log.warning
            level("%s", out["throughput"]["message"])
        return out

    def on_kill(self) -> None:
        # Workers stop at their next block; temp files are removed; files already renamed stay
        # and the journal lets the next try resume.
        self._cancel.set()
