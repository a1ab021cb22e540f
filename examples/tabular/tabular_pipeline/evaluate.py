"""Held-out metrics of a trained model: ``evaluate(model_path, heldout) -> {"rmse", "mae", "r2", "samples"}``.

``heldout`` is a CSV file as a local path, ``file://`` or ``s3://`` URL, opened with fsspec. For
S3, s3fs takes credentials and the endpoint from the standard AWS environment (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...): botocore reads AWS_ENDPOINT_URL itself when s3fs is
given no endpoint, so nothing here passes one.
"""

from __future__ import annotations

import csv
import io

import fsspec
import numpy as np

from tabular_pipeline.prep import features_and_target

MAX_BYTES = 256 << 20  # a held-out set bigger than this is a mistake, not something to load into memory


def read_heldout(heldout: str, max_bytes: int = MAX_BYTES) -> tuple[np.ndarray, np.ndarray]:
    """X float32 [n, 8] and y float32 [n] from the CSV at ``heldout``, parsed as training parsed it."""
    with fsspec.open(heldout, "rb") as fh:
        data = fh.read(max_bytes + 1)  # one byte more than allowed tells "too big" from "exactly the limit"
    if len(data) > max_bytes:
        raise ValueError(f"{heldout}: held-out file is larger than {max_bytes} bytes")
    rows = csv.DictReader(io.StringIO(data.decode("utf-8-sig")))
    x, y = features_and_target(rows)
    if len(y) == 0:
        raise ValueError(f"{heldout}: no labelled rows to evaluate on")
    return x, y


def load_model(model_path: str):
    """The trained regressor as a torch module (MlflowRegistry's ``load_model``: what consumers of
    ``models:/<name>@champion`` get back from ``mlflow.pytorch.load_model``)."""
    import torch

    from tabular_pipeline.train import build_model

    model = build_model()
    model.load_state_dict(torch.load(model_path, map_location="cpu", weights_only=True))
    return model.eval()


def predict(model_path: str, x: np.ndarray) -> np.ndarray:
    import torch

    model = load_model(model_path)
    with torch.no_grad():
        return model(torch.from_numpy(x)).squeeze(1).numpy()


def regression_metrics(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """RMSE, MAE and R² as plain floats (float64 sums: float32 loses digits over many rows)."""
    y, pred = y.astype(np.float64), pred.astype(np.float64)
    err = pred - y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float((err ** 2).sum())
    return {
        "rmse": float(np.sqrt(np.mean(err ** 2))),
        "mae": float(np.mean(np.abs(err))),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0,
    }


def evaluate(model_path: str, heldout: str) -> dict[str, float]:
    """Metrics of the model at ``model_path`` on the held-out CSV at ``heldout`` (path or URL)."""
    x, y = read_heldout(heldout)
    return {**regression_metrics(y, predict(model_path, x)), "samples": int(len(y))}
