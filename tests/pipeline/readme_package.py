"""A new user's own pipeline package, written outside the repository from the README's text alone, as
the issue-23 user wrote theirs: a synthetic two-moons classifier with its own transform, DDP training
script and evaluate returning f1, and a DAG file that is the README's factory example with only the
names changed (:func:`dag_file_from_readme`). test_readme_pipeline.py writes it while Airflow runs,
into the folder tests/pipeline/conftest.py put on Airflow's PYTHONPATH and DAG bundles.
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
#: the dates the README's backfill recipe names; each has raw data
DATES = ("2026-02-01", "2026-02-02", "2026-02-03")

PREP = '''"""One CSV row {"x1", "x2", "label"} -> {"x": float32 [2], "y": int64}; rows without a label dropped."""
import numpy as np


def transform(record):
    if not str(record.get("label", "")).strip():
        return None
    return {"x": np.array([float(record["x1"]), float(record["x2"])], dtype=np.float32),
            "y": np.int64(int(record["label"]))}
'''

TRAIN = '''"""DDP training of a small two-moons classifier on the staged shards (run on every rank)."""
import argparse
import os

import torch

from dtrain.training import exit_now, init_distributed, write_result
from dtrain.training.shards import ShardDataset


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


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
    for _ in range(args.epochs):
        for start in range(0, len(mine) - 31, 32):  # equal step counts on every rank: full batches only
            x, y = dataset.get_batch(mine[start:start + 32])
            loss = torch.nn.functional.cross_entropy(ddp(x), y.long())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    if ctx.rank == 0:
        torch.save(model.state_dict(), args.output + ".tmp")
        os.replace(args.output + ".tmp", args.output)
        write_result({"final_loss": float(loss), "warm_start_from": args.init_from or None})
    return 0


if __name__ == "__main__":
    exit_now(main())
'''

EVALUATE = '''"""evaluate(model_path, heldout) -> {"f1", "samples"} on the held-out CSV (s3:// or a path)."""
import csv
import io

import fsspec
import torch

from moons_pipeline.prep import transform
from moons_pipeline.train import build_model


def evaluate(model_path, heldout):
    with fsspec.open(heldout, "rb") as fh:
        rows = [transform(r) for r in csv.DictReader(io.StringIO(fh.read(16 << 20).decode()))]
    x = torch.tensor([r["x"] for r in rows if r])
    y = torch.tensor([int(r["y"]) for r in rows if r])
    model = build_model()
    model.load_state_dict(torch.load(model_path, weights_only=True))
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
)


def readme_factory_example(readme: str) -> str:
    """The README's factory example: the first Python block after "## Your own pipeline"."""
    section = readme[readme.index("## Your own pipeline"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def dag_file_from_readme(readme: str, shared_fs: str) -> str:
    """The README's example with this package's names, bucket and shared filesystem, nothing else."""
    text = readme_factory_example(readme)
    for old, new in RENAMES + (('"s3://acme-data', f'"s3://{BUCKET}'), ('shared_fs="/fsx"', f'shared_fs="{shared_fs}"')):
        assert old in text, f"the README's factory example no longer contains {old!r}"
        text = text.replace(old, new)
    return text


def write_package(root: str, readme: str, shared_fs: str) -> str:
    """<root>/moons_pipeline/ (the package) and <root>/dags/moons_retraining.py; returns the dags folder."""
    package, dags = os.path.join(root, PACKAGE), os.path.join(root, "dags")
    os.makedirs(package)
    os.makedirs(dags, exist_ok=True)
    for name, text in (("__init__.py", ""), ("prep.py", PREP), ("train.py", TRAIN), ("evaluate.py", EVALUATE)):
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
        client.put_object(Bucket=BUCKET, Key=f"raw/v1/{date}/part-0.csv", Body=moons_csv(800, seed))
    client.put_object(Bucket=BUCKET, Key="heldout/v1/heldout.csv", Body=moons_csv(500, 99))
