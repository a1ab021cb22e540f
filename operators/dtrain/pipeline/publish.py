"""Evaluate a trained model on held-out data and publish it atomically, keyed by version and partition.

Layout: <models>/<version>/<partition>/{model.pt, metrics.json}. A model directory is
assembled under a hidden temporary name and renamed into place, so a reader never sees a
half-published model; ``metrics.json`` is the last file written into it.
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


class PublishError(DTrainError):
    """The model cannot be published (missing, or below the accuracy bar)."""


def model_dir(models_root: str, version: str, partition: str) -> str:
    return os.path.join(models_root, version, partition)


def previous_model(models_root: str, version: str, partition: str) -> str:
    """The newest published model of ``version`` strictly before ``partition`` ('' if none): the warm start.

    Strictly before, so a rerun of a date starts from the same weights as its first run.
    """
    root = os.path.join(models_root, version)
    try:
        names = sorted(n for n in os.listdir(root) if PARTITION_RE.match(n) and n < partition)
    except OSError:
        return ""
    for name in reversed(names):
        path = os.path.join(root, name, "model.pt")
        if os.path.isfile(os.path.join(root, name, "metrics.json")) and os.path.isfile(path):
            return path
    return ""


def evaluate_model(model_path: str, hidden: int = 128, seed: int = 0) -> float:
    """Accuracy of the saved reference model on the held-out digits test split."""
    import torch

    from dtrain.training.reference.train_digits import build_model, evaluate, load_digits_split

    if not os.path.isfile(model_path):
        raise PublishError(f"model_path={model_path!r} does not exist")
    model = build_model(hidden)
    model.load_state_dict(torch.load(model_path, map_location="cpu"))
    _, test = load_digits_split(seed)
    return evaluate(model, test, torch.device("cpu"))


def publish_model(model_path: str, metrics: dict[str, Any], models_root: str, version: str,
                  partition: str) -> dict[str, Any]:
    """Copy the model and its metrics into place atomically; return where they are."""
    if not os.path.isfile(model_path):
        raise PublishError(f"model_path={model_path!r} does not exist")
    final = model_dir(models_root, version, partition)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{partition}.{uuid.uuid4().hex[:8]}.tmp")
    os.makedirs(tmp)
    shutil.copy2(model_path, os.path.join(tmp, "model.pt"))
    with open(os.path.join(tmp, "metrics.json"), "w", encoding="utf-8") as fh:
        json.dump(metrics, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    if os.path.isdir(final):  # a rerun of this partition: swap, never leave it half-replaced
        old = os.path.join(parent, f".{partition}.{uuid.uuid4().hex[:8]}.old")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    return {"model_dir": final, "model_path": os.path.join(final, "model.pt"),
            "metrics_path": os.path.join(final, "metrics.json"), "metrics": metrics}
