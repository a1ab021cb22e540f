"""The per-document transform dtrain's preprocessing runs: text -> token ids, a variable-length field.

``dtrain preprocess --transform text_pipeline.prep:transform --pack input_ids --block-size 64
--separator 1`` calls :func:`transform` with one JSON-lines record. Returning None drops the record
(no text); raising ValueError quarantines it as a bad record. With packing, dtrain joins each shard's
documents, each followed by ``<eos>`` (id 1), and cuts 64-token blocks: what training reads.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from dtrain.preprocess.transform import variable_length

from text_pipeline import tokenizer

# Part of the shards' fingerprint with the tokenizer's own hash: a new tokenizer makes new shards.
TRANSFORM_VERSION = f"1+tokenizer.{tokenizer.fingerprint()}"
TOKEN_DTYPE = np.uint16  # the vocabulary (512) fits: half the bytes of int32, as nanoGPT stores GPT-2's


def token_ids(text: Any) -> np.ndarray:
    """One document's token ids (no separator: packing adds it)."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a string, got {type(text).__name__}")
    return np.asarray(tokenizer.load().encode(text).ids, dtype=TOKEN_DTYPE)


@variable_length("input_ids")
def transform(record: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    """``{"id", "text"}`` -> ``{"input_ids": uint16 [any length]}``; None for a record without text."""
    text = record.get("text")
    if text is None or isinstance(text, str) and not text.strip():
        return None
    return {"input_ids": token_ids(text)}
