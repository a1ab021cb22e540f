"""DeepSpeed config checks done before launch, mirroring DeepSpeed's own batch arithmetic.

train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size.
Any one missing field is derived from the other two; with two missing,
gradient_accumulation_steps defaults to 1 (as DeepSpeed does).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from dtrain.errors import SpecError

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
# DeepSpeed's own configs nest a few levels and weigh kilobytes; these bounds keep a hostile one
# from exhausting the parser (a 100k-deep config hit RecursionError) or memory.
MAX_DEPTH = 32
MAX_BYTES = 1 << 20


def json_depth(text: str) -> int:
    """The deepest nesting of objects/arrays in JSON ``text``, counted without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def mapping_depth(value: Any) -> int:
    """The deepest nesting of mappings/lists in ``value``, iteratively (no recursion to exhaust)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, (list, tuple)) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def load_deepspeed_config(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if value is None:
        raise SpecError("deepspeed_config", None, "a DeepSpeed JSON config (path or mapping) is required with distribution='deepspeed'")
    if isinstance(value, Mapping):
        if mapping_depth(value) > MAX_DEPTH:
            raise SpecError("deepspeed_config", "<mapping>", f"at most {MAX_DEPTH} levels of nesting")
        return dict(value)
    text = str(value).strip()
    if text.startswith("{"):
        source = text
    else:
        if not os.path.isfile(text):
            raise SpecError("deepspeed_config", text, "an existing JSON file, or a JSON object")
        with open(text, encoding="utf-8") as fh:
            source = fh.read(MAX_BYTES + 1)
    if len(source) > MAX_BYTES:
        raise SpecError("deepspeed_config", text[:200], f"at most {MAX_BYTES} bytes of JSON")
    if json_depth(source) > MAX_DEPTH:
        raise SpecError("deepspeed_config", text[:200], f"at most {MAX_DEPTH} levels of nesting")
    try:
        config = json.loads(source)
    except json.JSONDecodeError as e:
        raise SpecError("deepspeed_config", text, f"valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    if not isinstance(config, dict):
        raise SpecError("deepspeed_config", text, "a JSON object at top level")
    return config


def _positive(config: Mapping[str, Any], key: str) -> int | None:
    if key not in config or config[key] in (None, "auto"):
        return None
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"deepspeed_config.{key}", value, "a positive integer")
    return value


def resolve_deepspeed_config(value: str | Mapping[str, Any] | None, world_size: int) -> dict[str, Any]:
    """Validate the batch fields against ``world_size`` and fill in the missing ones."""
    config = load_deepspeed_config(value)
    tbs, micro, gas = _positive(config, TBS), _positive(config, MICRO), _positive(config, GAS)
    if tbs is None and micro is None:
        raise SpecError("deepspeed_config", {TBS: None, MICRO: None}, f"at least one of {TBS} or {MICRO}")
    if gas is None and (tbs is None or micro is None):
        gas = 1
    if tbs is None:
        tbs = micro * gas * world_size
    elif micro is None:
        if tbs % (gas * world_size):
            raise SpecError(f"deepspeed_config.{TBS}", tbs,
                            f"divisible by {GAS} x world size = {gas} x {world_size}")
        micro = tbs // (gas * world_size)
    elif gas is None:
        if tbs % (micro * world_size):
            raise SpecError(f"deepspeed_config.{TBS}", tbs,
                            f"divisible by {MICRO} x world size = {micro} x {world_size}")
        gas = tbs // (micro * world_size)
    if tbs != micro * gas * world_size:
        raise SpecError(
            f"deepspeed_config.{TBS}", tbs,
            f"must equal {MICRO} x {GAS} x world size = {micro} x {gas} x {world_size} = {micro * gas * world_size}",
        )
    config.update({TBS: tbs, MICRO: micro, GAS: gas})
    return config
