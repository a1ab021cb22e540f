"""Packing for language models: token sequences joined by a separator and cut into fixed-length blocks.

The standard causal-LM recipe (Hugging Face's ``group_texts``, GPT-2's training data): every
sequence of the shard, each followed by ``separator`` (an end-of-text token), end to end, cut into
``block_size`` tokens. The blocks are a fixed-shape field, read at the fixed fields' full speed;
no token is padding. A shard is packed on its own (its chunk is in one worker), so shards stay
independent and deterministic, and each drops its last ``< block_size`` tokens (counted in the
manifest's ``packing``).

Parsing the option imports nothing heavy: the pipeline factory checks it when the DAG is parsed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from dtrain.errors import SpecError
from dtrain.preprocess.transform import FIELD_NAME

MAX_BLOCK_SIZE = 1 << 20
ALLOWED = (f'{{"field": NAME, "block_size": 1..{MAX_BLOCK_SIZE}, "separator": a token id or null}}: '
           "the transform's variable-length integer field to pack, the tokens per block, and the token "
           "put after every sequence (null: none)")


@dataclass(frozen=True)
class Packing:
    field: str
    block_size: int
    separator: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def packing_option(value: Any) -> Packing | None:
    """``pack`` as given (None, a Packing, a mapping or its JSON text) checked, or SpecError naming it."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except ValueError:
            raise SpecError("pack", value, ALLOWED) from None
    if value is None:
        return None
    if isinstance(value, Packing):
        value = value.as_dict()
    if not isinstance(value, dict) or "field" not in value or set(value) - {"field", "block_size", "separator"}:
        raise SpecError("pack", value, ALLOWED)
    packing = Packing(value["field"], value.get("block_size"), value.get("separator"))
    if not _valid(packing):
        raise SpecError("pack", value, ALLOWED)
    return packing


def _valid(p: Packing) -> bool:
    return (isinstance(p.field, str) and bool(FIELD_NAME.match(p.field)) and _whole(p.block_size)
            and 1 <= p.block_size <= MAX_BLOCK_SIZE and (p.separator is None or _whole(p.separator)))


def pack(sequences: list, dtype, packing: Packing):
    """Sequences (1-D integer arrays of ``dtype``) -> ([blocks, block_size] array, counts for the manifest).

    Raises PreprocessError when the field is not integer or the separator does not fit its dtype:
    a setting that no record can fix, so the task fails instead of quarantining every record.
    """
    import numpy as np

    from dtrain.preprocess.errors import PreprocessError

    if dtype.kind not in "iu":
        raise PreprocessError(f"pack: field {packing.field} has dtype {dtype}; packing joins token ids: "
                              f"an integer dtype is required")
    parts = list(sequences)
    if packing.separator is not None:
        info = np.iinfo(dtype)
        if not info.min <= packing.separator <= info.max:
            raise PreprocessError(f"pack: separator={packing.separator} does not fit field {packing.field}'s "
                                  f"dtype {dtype} (allowed: {info.min} to {info.max})")
        separator = np.array([packing.separator], dtype=dtype)
        parts = [piece for seq in sequences for piece in (seq, separator)]
    stream = np.concatenate(parts).astype(np.dtype(dtype.name), copy=False) if parts else np.empty(0, dtype)
    blocks = len(stream) // packing.block_size
    used = blocks * packing.block_size
    counts = {"sequences": len(sequences), "tokens": int(len(stream)), "dropped_tokens": int(len(stream) - used)}
    return stream[:used].reshape(blocks, packing.block_size), counts
