"""Airflow operators for preprocessing: one mapped task per input partition, then a finalize.

    from dtrain.preprocess.operator import PreprocessOperator, PreprocessFinalizeOperator

    parts = PreprocessOperator.partial(
        task_id="preprocess", transform="mypkg.prep:transform",
        output_path="/fsx/datasets/digits/{{ ds }}",          # keyed by logical date: backfill-safe
    ).expand(input=["s3://raw/{{ ds }}/part-0.jsonl", "s3://raw/{{ ds }}/part-1.jsonl"])
    publish = PreprocessFinalizeOperator(task_id="publish", output_path="/fsx/datasets/digits/{{ ds }}",
                                         partitions=parts.output)

Each mapped task runs its partition over every core of its worker; a retry keeps the
shards already written. The finalize task checks the bad-record fraction over the whole
dataset and writes manifest.json last. Thin over :mod:`dtrain.preprocess.runner`;
nothing heavy is imported at parse time and ``__init__`` does no I/O.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from airflow.sdk import BaseOperator

from dtrain.preprocess.inputs import DEFAULT_MAX_RECORD_BYTES

DEFAULT_MAX_BAD_FRACTION = 0.001
DEFAULT_SHARD_SIZE = 8192
TEMPLATE_MARKS = ("{{", "{%", "{#")  # Jinja expression, statement, comment


def literal_transform(value: Any) -> Any:
    """Refuse a transform that is a Jinja template. ``transform`` names the code this task runs, so
    it is not a templated field: a template rendered from params (or a UI user's conf) would let
    whoever triggers the run choose that code. The unrendered text is refused here, before anything
    is imported, rather than left to fail as a malformed import path."""
    from dtrain.errors import SpecError

    if isinstance(value, str) and any(mark in value for mark in TEMPLATE_MARKS):
        raise SpecError("transform", value, "a literal import path MODULE:FUNCTION written in the DAG: transform is "
                                            "never templated (it names the code to run), so Jinja is not rendered")
    return value


def _coerce_fraction(value: Any) -> float:
    from dtrain.errors import SpecError

    try:
        number = float(value)
    except (TypeError, ValueError) as e:
        raise SpecError("max_bad_fraction", value, "a fraction between 0 and 1") from e
    return number


@contextlib.contextmanager
def aws_credentials_env(conn_id: str | None) -> Iterator[None]:
    """Expose an Airflow AWS connection to this task's process and its spawned workers as the
    standard AWS variables (what s3fs/botocore read), for the duration of the task only.

    Never logged, never in argv or XCom; the previous environment is restored afterwards.
    """
    if not conn_id:
        yield
        return
    from dtrain.environ import temporarily
    from dtrain.hooks.aws import aws_environment

    with temporarily(aws_environment(conn_id)):
        yield


class PreprocessOperator(BaseOperator):
    """Apply ``transform`` to one input partition and write its shards under ``output_path/parts/<partition>``.

    Args:
        transform: import path ``module:function`` (one parsed record in, dict of arrays or None out).
            Not templated: it names code to run, so it must be written in the DAG, not come from params.
        input: a URL (file, directory or glob; any fsspec filesystem) or a list of URLs: one partition.
            Map over this with ``.expand(input=[...])``.
        output_path: the dataset directory or URL shared by every partition (templated; key it by ``{{ ds }}``).
        partition: the partition's name (default: derived from the input URL).
        workers: processes on this worker (default: every core).
        max_bad_fraction: fail this task above this fraction of bad records (default 0.001).
        shard_size: input records per shard.
        max_record_bytes: the largest input record (line, .npy row) read, default 64 MiB; a longer
            line is quarantined without being read into memory (a decompression bomb).
        pack: ``{"field": "input_ids", "block_size": 1024, "separator": EOS_ID}`` packs the transform's
            variable-length token field into fixed-length blocks (:mod:`dtrain.preprocess.packing`);
            checked when the DAG is parsed. Not templated: it decides what the dataset holds.
        aws_conn_id: Airflow AWS connection for s3:// inputs and outputs (its credentials reach the
            workers as the standard AWS variables, for this task only; never logged).

    Returns (XCom): name, inputs, records, samples, dropped, bad, bytes, shard count, path.
    """

    # Not "transform": see literal_transform.
    template_fields: Sequence[str] = ("input", "output_path", "partition", "workers",
                                      "max_bad_fraction", "shard_size", "max_record_bytes")
    ui_color = "#e8f3d6"

    def __init__(self, *, transform: str, input: str | list[str], output_path: str, partition: str | None = None,
                 workers: int | str | None = None, max_bad_fraction: float | str = DEFAULT_MAX_BAD_FRACTION,
                 shard_size: int | str = DEFAULT_SHARD_SIZE, aws_conn_id: str | None = None,
                 max_record_bytes: int | str = DEFAULT_MAX_RECORD_BYTES, pack: Any = None, **kwargs: Any) -> None:
        from dtrain.preprocess.packing import packing_option

        super().__init__(**kwargs)
        packing = packing_option(pack)
        self.pack = packing and packing.as_dict()
        self.aws_conn_id = aws_conn_id
        self.max_record_bytes = max_record_bytes
        self.transform = transform
        self.input = input
        self.output_path = output_path
        self.partition = partition
        self.workers = workers
        self.max_bad_fraction = max_bad_fraction
        self.shard_size = shard_size

    def execute(self, context) -> dict[str, Any]:
        from dtrain.args import coerce_int
        from dtrain.preprocess.runner import coerce_max_record_bytes, process_partition

        transform = literal_transform(self.transform)
        workers = None if self.workers in (None, "", "None") else coerce_int("workers", self.workers, minimum=1)
        inputs = list(self.input) if isinstance(self.input, (list, tuple)) else self.input
        with aws_credentials_env(self.aws_conn_id):
            return process_partition(
                inputs, self.output_path, transform, partition=self.partition or None, workers=workers,
                shard_size=coerce_int("shard_size", self.shard_size, minimum=1),
                max_bad_fraction=_coerce_fraction(self.max_bad_fraction), log=self.log.info,
                max_record_bytes=coerce_max_record_bytes(self.max_record_bytes), pack=self.pack,
            )

    def on_kill(self) -> None:
        from dtrain.preprocess.runner import terminate_active

        self.log.info("on_kill: stopping the preprocessing workers (finished shards are kept for the retry)")
        terminate_active()


def partition_names(partitions: Any) -> list[Any]:
    """What the mapped preprocessing tasks returned (or the names given), as a list, in one read.

    The mapped tasks' XComArg arrives as Airflow's lazy sequence: iterating it asks for item after
    item until one is missing, and the Task SDK logs that last, expected miss as an ``[error] XCom
    not found ... offset=N`` line on every successful run. A slice is one request for all of them."""
    if isinstance(partitions, Sequence) and not isinstance(partitions, (str, bytes)):
        return list(partitions[:])
    return list(partitions)


class PreprocessFinalizeOperator(BaseOperator):
    """Publish the dataset: check every partition, merge quarantine.jsonl, write manifest.json last.

    Args:
        output_path: the dataset directory or URL (templated). (``output`` is taken: it is
            Airflow's XComArg of the task.)
        partitions: what the mapped PreprocessOperator returned (``parts.output``), or partition
            names; None publishes every finished partition under ``output_path``.
        max_bad_fraction: fail (publishing nothing) above this fraction over the whole dataset.
        aws_conn_id: Airflow AWS connection for an s3:// output_path.

    Returns (XCom): manifest path, num_samples, shards, partitions, records, bad_records, fields.
    """

    template_fields: Sequence[str] = ("output_path", "partitions", "max_bad_fraction")
    ui_color = "#c9e4b0"

    def __init__(self, *, output_path: str, partitions: Any = None,
                 max_bad_fraction: float | str = DEFAULT_MAX_BAD_FRACTION, aws_conn_id: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.aws_conn_id = aws_conn_id
        self.output_path = output_path
        self.partitions = partitions
        self.max_bad_fraction = max_bad_fraction

    def execute(self, context) -> dict[str, Any]:
        from dtrain.preprocess.runner import finalize_dataset

        partitions = None if self.partitions is None else partition_names(self.partitions)
        with aws_credentials_env(self.aws_conn_id):
            return finalize_dataset(self.output_path, partitions,
                                    max_bad_fraction=_coerce_fraction(self.max_bad_fraction), log=self.log.info)
