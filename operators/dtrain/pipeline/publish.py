"""Publish a trained model atomically, keyed by pipeline, dataset version and partition; find the
last published one (the warm start and the gate's baseline).

Layout: ``<models>/<pipeline>/<version>/<partition>/{<model_name>, metrics.json}``, where
``model_name`` (``model.pt`` by default) is a file or a directory (a Hugging Face
``save_pretrained`` folder, say). A model directory is assembled under a hidden temporary
name and renamed into place, so a reader never sees a half-published model; ``metrics.json``
is the last file written into it, and a partition counts as published only when it exists.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any

from dtrain.errors import DTrainError

PARTITION_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
METRICS_FILE = "metrics.json"
#: metrics.json is written by this module; a larger one is not ours (bounded read)
MAX_METRICS_BYTES = 4 << 20


class PublishError(DTrainError):
    """The model cannot be published (missing, not a regular file or directory)."""


def model_dir(models_root: str, version: str, partition: str) -> str:
    return os.path.join(models_root, version, partition)


def _published_partitions(models_root: str, version: str, before: str) -> list[str]:
    root = os.path.join(models_root, version)
    try:
        return sorted((n for n in os.listdir(root) if PARTITION_RE.match(n) and n < before), reverse=True)
    except OSError:
        return []


def previous_model(models_root: str, version: str, partition: str, model_name: str = "model.pt") -> str:
    """The newest published model of ``version`` strictly before ``partition`` ('' if none): the warm start.

    Strictly before, so a rerun of a date starts from the same weights as its first run, and
    backfilled dates each compare with the model published before them.
    """
    found = previous_published(models_root, version, partition, model_name)
    return found[0] if found else ""


def previous_published(models_root: str, version: str, partition: str,
                       model_name: str = "model.pt") -> tuple[str, dict[str, Any]] | None:
    """``(model path, its metrics.json)`` for :func:`previous_model`'s model, or None."""
    for name in _published_partitions(models_root, version, partition):
        directory = model_dir(models_root, version, name)
        path = os.path.join(directory, model_name)
        metrics = os.path.join(directory, METRICS_FILE)
        if os.path.exists(path) and os.path.isfile(metrics) and not os.path.islink(metrics):
            with open(metrics, "rb") as fh:
                data = fh.read(MAX_METRICS_BYTES + 1)
            if len(data) > MAX_METRICS_BYTES:
                raise PublishError(f"{metrics} is larger than {MAX_METRICS_BYTES} bytes: not written by dtrain")
            return path, json.loads(data)
    return None


def _copy_model(model_path: str, destination: str) -> None:
    # Never follow a link we did not make: a link as the model is refused, links inside a model
    # directory are copied as links (their targets are not read).
    if os.path.islink(model_path):
        raise PublishError(f"model_path={model_path!r} is a symbolic link: publish the file or directory itself")
    if os.path.isdir(model_path):
        shutil.copytree(model_path, destination, symlinks=True)
    elif os.path.isfile(model_path):
        shutil.copy2(model_path, destination)
    else:
        raise PublishError(f"model_path={model_path!r} does not exist: the training command did not write "
                           "its model to {output}")


def publish_model(model_path: str, record: dict[str, Any], models_root: str, version: str, partition: str,
                  model_name: str = "model.pt") -> dict[str, Any]:
    """Copy the model and its record (metrics.json) into place atomically; return where they are."""
    final = model_dir(models_root, version, partition)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{partition}.{uuid.uuid4().hex[:8]}.tmp")
    os.makedirs(tmp)
    try:
        _copy_model(model_path, os.path.join(tmp, model_name))
        with open(os.path.join(tmp, METRICS_FILE), "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=2, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(final):  # a rerun of this partition: swap, never leave it half-replaced
        old = os.path.join(parent, f".{partition}.{uuid.uuid4().hex[:8]}.old")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    return {"model_dir": final, "model_path": os.path.join(final, model_name),
            "metrics_path": os.path.join(final, METRICS_FILE)}
