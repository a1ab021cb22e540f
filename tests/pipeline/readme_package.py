"""A new user's own pipeline package, written outside the repository from the README's text alone, as
a new team writes theirs: a synthetic two-moons classifier (its own network class) with its own
transform, DDP training script and evaluate returning f1, and a DAG file that is the README's factory
example with only the names changed, its ``shared_fs`` a folder of the team's own and MLflow as its
registry, as the README's *MLflow as the registry and tracker* paragraph says to give it
(:func:`dag_file_from_readme`). test_readme_pipeline.py writes it while Airflow runs, into the folder
tests/pipeline/conftest.py put on Airflow's PYTHONPATH and DAG bundles.
"""

from __future__ import annotations

import csv
import io
import os
import re

import numpy as np

PACKAGE = "moons_pipeline"
DAG_ID = "moons_retraining"
BUCKET = "moons-data"
#: the registered model's name (the README's "tabular-rmse")
MODEL = "moons-f1"
#: the dates the README's backfill recipe names; each has raw data
DATES = ("2026-02-01", "2026-02-02", "2026-02-03")
#: rows of raw data per date; the training script's steps per rank: 4 epochs of full batches of 32
ROWS = 800
STEPS = 4 * (ROWS // 2 // 32)

PREP = '''"""One CSV row {"x1", "x2", "label"} -> {"x": float32 [2], "y": int64}; rows without a label dropped."""
import numpy as np


def transform(record):
    if not str(record.get("label", "")).strip():
        return None
    return {"x": np.array([float(record["x1"]), float(record["x2"])], dtype=np.float32),
            "y": np.int64(int(record["label"]))}
'''

MODEL_PY = '''"""The network: torch only, so that the registered model loads wherever torch does."""
import torch


class MoonsNet(torch.nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))

    def forward(self, x):
        return self.layers(x)


def build_model():
    return MoonsNet()
'''

TRAIN = '''"""DDP training of a small two-moons classifier on the staged shards (run on every rank)."""
import argparse
import os
import time

import torch

from dtrain.training import MetricsWriter, exit_now, init_distributed, write_result
from dtrain.training.shards import ShardDataset
from moons_pipeline.model import build_model


def main():
    parser = argparse.ArgumentParser()
    for name in ("--shards", "--output", "--init-from"):
        parser.add_argument(name, default="")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    torch.manual_seed(0)
    ctx = init_distributed()
    dataset = ShardDataset(args.shards, fields=("x", "y"))
    mine = list(range(ctx.rank, len(dataset), ctx.world_size))
    model = build_model()
    if args.init_from:  # warm start from the model published before this date
        model.load_state_dict(torch.load(args.init_from, weights_only=True))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    metrics = MetricsWriter(ctx.rank)  # a JSON line per step: the Training tab's curves and verdicts
    step = 0
    for epoch in range(args.epochs):
        for start in range(0, len(mine) - 31, 32):  # equal step counts on every rank: full batches only
            began = time.perf_counter()
            x, y = dataset.get_batch(mine[start:start + 32])
            fetched = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(ddp(x), y.long())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            metrics.log(step=step, epoch=epoch, loss=float(loss), samples=len(y),
                        step_time_s=time.perf_counter() - began, data_wait_s=fetched - began)
    metrics.close()
    if ctx.rank == 0:
        torch.save(model.state_dict(), args.output + ".tmp")
        os.replace(args.output + ".tmp", args.output)
        write_result({"final_loss": float(loss), "warm_start_from": args.init_from or None})
    return 0


if __name__ == "__main__":
    exit_now(main())
'''

EVALUATE = '''"""evaluate(model_path, heldout) -> {"f1", "samples"} on the held-out CSV (s3:// or a path);
load_model(model_path): the trained network, for the registry to log as an MLflow Model."""
import csv
import io

import fsspec
import torch

from moons_pipeline.model import build_model
from moons_pipeline.prep import transform


def load_model(model_path):
    model = build_model()
    model.load_state_dict(torch.load(model_path, weights_only=True))
    return model


def evaluate(model_path, heldout):
    with fsspec.open(heldout, "rb") as fh:
        rows = [transform(r) for r in csv.DictReader(io.StringIO(fh.read(16 << 20).decode()))]
    x = torch.tensor([r["x"] for r in rows if r])
    y = torch.tensor([int(r["y"]) for r in rows if r])
    model = load_model(model_path)
    with torch.no_grad():
        predicted = model(x).argmax(1)
    tp = int(((predicted == 1) & (y == 1)).sum())
    fp, fn = int(((predicted == 1) & (y == 0)).sum()), int(((predicted == 0) & (y == 1)).sum())
    return {"f1": round(2 * tp / max(2 * tp + fp + fn, 1), 4), "samples": len(y)}
'''

#: the README's factory example -> this package: (README text, replacement), each present exactly once
RENAMES = (
    ("# dags/tabular_retraining.py", "# dags/moons_retraining.py"),
    ('"tabular_retraining"', f'"{DAG_ID}"'),
    ('"tabular_pipeline.prep:transform"', f'"{PACKAGE}.prep:transform"'),
    ('"tabular_pipeline.train"', f'"{PACKAGE}.train"'),
    ('"tabular_pipeline.evaluate:evaluate"', f'"{PACKAGE}.evaluate:evaluate"'),
    ('metric="rmse", goal="minimize", threshold=2.0', 'metric="f1", goal="maximize", threshold=0.5'),
    ('"tabular-rmse"', f'"{MODEL}"'),
    ('"tabular_pipeline.evaluate:load_model"', f'"{PACKAGE}.evaluate:load_model"'),
)


def readme_factory_example(readme: str) -> str:
    """The README's factory example: the first Python block after "## Your own pipeline"."""
    section = readme[readme.index("## Your own pipeline"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def readme_mlflow_registry(readme: str) -> tuple[str, str]:
    """The imports and the factory argument the README's *MLflow as the registry and tracker* paragraph
    gives (its argument spans a line break there)."""
    section = readme[readme.index("**MLflow as the registry and tracker**"):]
    argument = re.search(r"`(publish=PublishConfig\(registry=MlflowRegistry\(.*?\)\))`", section, re.S).group(1)
    imported = [re.search(rf"`({line})`", section).group(1) for line in (
        r"from dtrain\.pipeline import PublishConfig", r"from dtrain\.mlflow\.registry import MlflowRegistry")]
    return "\n".join(imported), re.sub(r"\n\s*", "", argument)


def with_mlflow_registry(example: str, readme: str) -> str:
    """The factory example given the README's MlflowRegistry: its imports, and the argument to the call."""
    imported, argument = readme_mlflow_registry(readme)
    for anchor, added in ((" retraining_pipeline\n", f"{imported}\n"),
                          ('    schedule="@daily"', f"    {argument},\n")):
        assert example.count(anchor) == 1, f"the README's factory example no longer has one {anchor!r}"
        at = example.index(anchor) + (len(anchor) if anchor.endswith("\n") else 0)
        example = example[:at] + added + example[at:]
    return example


def dag_file_from_readme(readme: str, shared_fs: str) -> str:
    """The README's example with the README's MlflowRegistry, this package's names, bucket and shared
    filesystem, nothing else."""
    text = with_mlflow_registry(readme_factory_example(readme), readme)
    for old, new in RENAMES + (('"s3://acme-data', f'"s3://{BUCKET}'), ('shared_fs="/fsx"', f'shared_fs="{shared_fs}"')):
        assert old in text, f"the README's factory example no longer contains {old!r}"
        text = text.replace(old, new)
    return text


def write_package(root: str, readme: str, shared_fs: str) -> str:
    """<root>/moons_pipeline/ (the package) and <root>/dags/moons_retraining.py; returns the dags folder."""
    package, dags = os.path.join(root, PACKAGE), os.path.join(root, "dags")
    os.makedirs(package)
    os.makedirs(dags, exist_ok=True)
    for name, text in (("__init__.py", ""), ("prep.py", PREP), ("model.py", MODEL_PY), ("train.py", TRAIN),
                       ("evaluate.py", EVALUATE)):
        with open(os.path.join(package, name), "w", encoding="utf-8") as fh:
            fh.write(text)
    with open(os.path.join(dags, f"{DAG_ID}.py"), "w", encoding="utf-8") as fh:
        fh.write(dag_file_from_readme(readme, shared_fs))
    return dags


def moons_csv(rows: int, seed: int, noise: float = 0.15) -> bytes:
    """Two interleaved half circles, labels 0 and 1, with Gaussian noise: CSV x1,x2,label."""
    rng = np.random.default_rng(seed)
    t, label = rng.uniform(0, np.pi, rows), rng.integers(0, 2, rows)
    x1 = np.where(label == 0, np.cos(t), 1 - np.cos(t)) + rng.normal(0, noise, rows)
    x2 = np.where(label == 0, np.sin(t), 0.5 - np.sin(t)) + rng.normal(0, noise, rows)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["x1", "x2", "label"])
    writer.writerows((f"{a:.5f}", f"{b:.5f}", int(c)) for a, b, c in zip(x1, x2, label))
    return out.getvalue().encode()


def seed_moons(client) -> None:
    """Raw data for the README's backfill dates and the held-out set, as the user's team uploads them."""
    client.create_bucket(Bucket=BUCKET)
    for seed, date in enumerate(DATES, start=1):
        client.put_object(Bucket=BUCKET, Key=f"raw/v1/{date}/part-0.csv", Body=moons_csv(ROWS, seed))
    client.put_object(Bucket=BUCKET, Key="heldout/v1/heldout.csv", Body=moons_csv(500, 99))
