"""DeepSpeed config checks done before launch, mirroring DeepSpeed's own batch arithmetic.

DeepSpeed (runtime/config.py, _configure_train_batch_size) checks

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x DP

where DP is the *data-parallel* size: the world size divided by the model-parallel (tensor)
and pipeline-parallel sizes, which DeepSpeed learns from the script (an ``mpu``, a
``PipelineModule``), not from the config. So:

* with all three fields given, ``train_batch_size / (micro x accumulation)`` is the DP size the
  config implies: it must be a whole number that divides the world size (and equal the DP size
  when the launch declares ``model_parallel_size`` / ``pipeline_parallel_size``). Nothing is
  rewritten;
* a missing field is derived with the DP size (the world size unless parallel sizes are
  declared: declare them, or give all three fields, when the script splits the model); with
  two missing, gradient_accumulation_steps is 1 (as DeepSpeed does). Only missing fields are
  added to the config the ranks get; a field the user gave is never changed.
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


def data_parallel_size(world_size: int, model_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> int:
    """world size / (tensor x pipeline parallel sizes); SpecError when it does not divide."""
    parallel = model_parallel_size * pipeline_parallel_size
    if world_size % parallel:
        raise SpecError("model_parallel_size x pipeline_parallel_size", parallel,
                        f"a divisor of the world size {world_size} (the rest is data parallel)")
    return world_size // parallel


def resolve_deepspeed_config(value: str | Mapping[str, Any] | None, world_size: int, model_parallel_size: int = 1,
                             pipeline_parallel_size: int = 1) -> dict[str, Any]:
    """Validate the batch fields as DeepSpeed will, and add the missing ones (see the module docstring)."""
    config = load_deepspeed_config(value)
    declared = model_parallel_size * pipeline_parallel_size > 1
    dp = data_parallel_size(world_size, model_parallel_size, pipeline_parallel_size)
    tbs, micro, gas = _positive(config, TBS), _positive(config, MICRO), _positive(config, GAS)
    if tbs is None and micro is None:
        raise SpecError("deepspeed_config", {TBS: None, MICRO: None}, f"at least one of {TBS} or {MICRO}")
    if tbs is not None and micro is not None and gas is not None:
        _check_all_three(tbs, micro, gas, world_size, dp if declared else None)
        return config
    if gas is None and (tbs is None or micro is None):
        gas = 1
    where = f"data-parallel size {dp}" if declared else f"world size {world_size}"
    derived: dict[str, int] = {}
    if tbs is None:
        derived[TBS] = micro * gas * dp
    elif micro is None:
        if tbs % (gas * dp):
            raise SpecError(f"deepspeed_config.{TBS}", tbs, f"divisible by {GAS} x {where} = {gas} x {dp}")
        derived[MICRO] = tbs // (gas * dp)
    else:
        if tbs % (micro * dp):
            raise SpecError(f"deepspeed_config.{TBS}", tbs, f"divisible by {MICRO} x {where} = {micro} x {dp}")
        derived[GAS] = tbs // (micro * dp)
    if GAS not in config or config[GAS] in (None, "auto"):
        derived.setdefault(GAS, gas)
    for key in (TBS, MICRO, GAS):  # only what the user left out (or set to "auto")
        if key in derived and (key not in config or config[key] in (None, "auto")):
            config[key] = derived[key]
    return config


def _check_all_three(tbs: int, micro: int, gas: int, world_size: int, declared_dp: int | None) -> None:
    per_replica = micro * gas
    if declared_dp is not None:
        if tbs != per_replica * declared_dp:
            raise SpecError(f"deepspeed_config.{TBS}", tbs,
                            f"must equal {MICRO} x {GAS} x data-parallel size = {micro} x {gas} x {declared_dp} = "
                            f"{per_replica * declared_dp} (world size {world_size} over the declared "
                            "model and pipeline parallel sizes)")
        return
    implied = tbs // per_replica
    if tbs % per_replica or world_size % implied:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        allowed = ", ".join(str(per_replica * d) for d in divisors)
        raise SpecError(f"deepspeed_config.{TBS}", tbs,
                        f"{MICRO} x {GAS} x a data-parallel size dividing the world size {world_size}: "
                        f"{micro} x {gas} x one of {divisors} = one of {allowed}")
