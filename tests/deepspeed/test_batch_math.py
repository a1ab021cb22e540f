"""DeepSpeed's batch arithmetic before launch: train_batch_size = micro x accumulation x DATA-parallel size.

Configs DeepSpeed accepts are accepted (ZeRO, pipeline parallel, tensor parallel), a field the user
gave is never rewritten, a derived field uses the data-parallel size, impossible configs are refused
naming the field and what would be valid."""

from __future__ import annotations

import pytest

from dtrain.errors import SpecError
from dtrain.launch.core.deepspeed_config import resolve_deepspeed_config
from dtrain.launch.core.spec import LaunchSpec

TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
OK = ["python", "-c", "pass"]


def test_the_pipeline_parallel_config_deepspeed_accepts_is_accepted_unchanged():
    # 2 ranks, 2 pipeline stages: DP = 1, so 256 = 8 x 32 x 1. The old check (x world size) refused it.
    config = {TBS: 256, MICRO: 8, GAS: 32, "zero_optimization": {"stage": 0}}
    assert resolve_deepspeed_config(dict(config), world_size=2) == config
    assert resolve_deepspeed_config(dict(config), world_size=2, pipeline_parallel_size=2) == config
    spec = LaunchSpec(command=OK, procs_per_node=2, distribution="deepspeed", deepspeed_config=config)
    assert spec.resolved_deepspeed_config == config
    # The same three fields as pure data parallelism over 2 ranks would be 8 x 16 x 2: also accepted.
    assert resolve_deepspeed_config({TBS: 256, MICRO: 8, GAS: 16}, world_size=2)[GAS] == 16


@pytest.mark.parametrize("config, world, mp, pp, expected", [
    ({MICRO: 4}, 4, 1, 1, {TBS: 16, MICRO: 4, GAS: 1}),                    # ZeRO, pure DP
    ({MICRO: 4, GAS: 2}, 4, 1, 1, {TBS: 32, MICRO: 4, GAS: 2}),
    ({TBS: 32, GAS: 2}, 4, 1, 1, {TBS: 32, MICRO: 4, GAS: 2}),
    ({TBS: 32, MICRO: 4}, 4, 1, 1, {TBS: 32, MICRO: 4, GAS: 2}),
    ({MICRO: 4}, 4, 1, 2, {TBS: 8, MICRO: 4, GAS: 1}),                     # 2 stages: DP 2
    ({TBS: 256, MICRO: 8}, 2, 1, 2, {TBS: 256, MICRO: 8, GAS: 32}),        # derived with DP 1, not 2
    ({TBS: 64, MICRO: 4}, 8, 2, 2, {TBS: 64, MICRO: 4, GAS: 8}),           # tensor x pipeline = 4: DP 2
    ({MICRO: 2, GAS: "auto"}, 2, 1, 1, {TBS: 4, MICRO: 2, GAS: 1}),        # "auto" counts as not given
])
def test_a_missing_field_is_derived_with_the_data_parallel_size(config, world, mp, pp, expected):
    resolved = resolve_deepspeed_config(dict(config), world_size=world, model_parallel_size=mp,
                                        pipeline_parallel_size=pp)
    assert {k: resolved[k] for k in (TBS, MICRO, GAS)} == expected


def test_a_field_the_user_gave_is_never_rewritten():
    given = {TBS: 32, MICRO: 4, "zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}
    resolved = resolve_deepspeed_config(dict(given), world_size=4)
    assert {k: resolved[k] for k in given} == given and resolved[GAS] == 2


@pytest.mark.parametrize("config, world, mp, pp, field, allowed", [
    ({TBS: 100, MICRO: 8, GAS: 1}, 2, 1, 1, f"deepspeed_config.{TBS}",
     f"{MICRO} x {GAS} x a data-parallel size dividing the world size 2: 8 x 1 x one of [1, 2] = one of 8, 16"),
    ({TBS: 24, MICRO: 4, GAS: 2}, 2, 1, 1, f"deepspeed_config.{TBS}",  # 24 / 8 = 3 ranks of data: not a divisor of 2
     f"{MICRO} x {GAS} x a data-parallel size dividing the world size 2: 4 x 2 x one of [1, 2] = one of 8, 16"),
    ({TBS: 256, MICRO: 8, GAS: 16}, 2, 1, 2, f"deepspeed_config.{TBS}",  # declared 2 stages: DP 1
     f"must equal {MICRO} x {GAS} x data-parallel size = 8 x 16 x 1 = 128 (world size 2 over the declared "
     "model and pipeline parallel sizes)"),
    ({MICRO: 4}, 3, 1, 2, "model_parallel_size x pipeline_parallel_size", "a divisor of the world size 3 (the rest "
                                                                          "is data parallel)"),
    ({TBS: 10, GAS: 1}, 4, 1, 1, f"deepspeed_config.{TBS}", f"divisible by {GAS} x world size 4 = 1 x 4"),
    ({TBS: 12, MICRO: 4}, 4, 1, 2, f"deepspeed_config.{TBS}",
     f"divisible by {MICRO} x data-parallel size 2 = 4 x 2"),
    ({GAS: 2}, 4, 1, 1, "deepspeed_config", f"at least one of {TBS} or {MICRO}"),
    ({MICRO: 0}, 4, 1, 1, f"deepspeed_config.{MICRO}", "a positive integer"),
])
def test_an_impossible_config_is_refused_naming_what_would_do(config, world, mp, pp, field, allowed):
    with pytest.raises(SpecError) as info:
        resolve_deepspeed_config(dict(config), world_size=world, model_parallel_size=mp, pipeline_parallel_size=pp)
    assert (info.value.field, info.value.allowed) == (field, allowed)


def test_parallel_sizes_only_with_deepspeed():
    with pytest.raises(SpecError) as info:
        LaunchSpec(command=OK, procs_per_node=2, pipeline_parallel_size=2)
    assert info.value.field == "model_parallel_size x pipeline_parallel_size"
    with pytest.raises(SpecError) as info:
        LaunchSpec(command=OK, procs_per_node=2, distribution="deepspeed", deepspeed_config={MICRO: 1},
                   model_parallel_size=0)
    assert info.value.field == "model_parallel_size"
