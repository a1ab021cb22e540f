"""Held-out perplexity of a trained model: ``evaluate(model_path, heldout) -> {"perplexity", "loss", "tokens", ...}``.

``heldout`` is a JSON-lines file of documents (a local path, ``file://`` or ``s3://`` URL, opened with
fsspec; for S3 the standard AWS environment variables apply). Its documents go through the same
transform as training (:mod:`text_pipeline.prep`) and the same packing (dtrain's own, each document
followed by ``<eos>``, blocks of the model's context length), so the loss is measured on exactly the
kind of block the model was trained on. Perplexity = exp(mean next-token cross-entropy): lower is better.
"""

from __future__ import annotations

import json
import math

import fsspec
import numpy as np

from dtrain.preprocess.packing import Packing, pack

from text_pipeline.prep import TOKEN_DTYPE, transform
from text_pipeline.tokenizer import EOS_ID

MAX_BYTES = 64 << 20  # a held-out set bigger than this is a mistake, not something to load into memory


def read_heldout(heldout: str, max_bytes: int = MAX_BYTES) -> list[np.ndarray]:
    """Each held-out document's token ids, tokenized as training tokenized it (records without text left out)."""
    with fsspec.open(heldout, "rb") as fh:
        data = fh.read(max_bytes + 1)  # one byte more than allowed tells "too big" from "exactly the limit"
    if len(data) > max_bytes:
        raise ValueError(f"{heldout}: held-out file is larger than {max_bytes} bytes")
    outputs = (transform(json.loads(line)) for line in data.decode("utf-8").splitlines() if line.strip())
    return [out["input_ids"] for out in outputs if out is not None]


def perplexity(model, blocks: np.ndarray, batch_size: int = 64) -> tuple[float, int]:
    """(mean next-token loss, tokens predicted) of ``model`` over packed ``blocks``."""
    import torch

    from text_pipeline.model import next_token_loss

    total, predicted = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(blocks), batch_size):
            batch = torch.from_numpy(blocks[start:start + batch_size])
            tokens = batch.shape[0] * (batch.shape[1] - 1)
            total += float(next_token_loss(model, batch)) * tokens
            predicted += tokens
    return total / max(predicted, 1), predicted


def evaluate(model_path: str, heldout: str) -> dict[str, float]:
    """Held-out metrics of the model at ``model_path`` on the documents at ``heldout`` (path or URL)."""
    from text_pipeline.model import load

    model = load(model_path)
    documents = read_heldout(heldout)
    blocks, counts = pack(documents, np.dtype(TOKEN_DTYPE), Packing("input_ids", model.config["block_size"], EOS_ID))
    if not len(blocks):
        raise ValueError(f"{heldout}: {counts['tokens']} tokens make no block of {model.config['block_size']}")
    loss, predicted = perplexity(model, blocks)
    return {"perplexity": math.exp(loss), "loss": loss, "tokens": predicted, "documents": len(documents)}
