"""Bad specs are refused before anything starts, with an error naming field, value and what is allowed."""

from __future__ import annotations

import json

import pytest

from dtrain.errors import SpecError
from dtrain.launch.deepspeed_config import resolve_deepspeed_config
from dtrain.launch.spec import LaunchSpec

from .conftest import script

OK = [script("dump_env.py")]


@pytest.mark.parametrize(
    "kwargs, field, fragment",
    [
        ({"nodes": 0}, "nodes", "at least 1"),
        ({"nodes": -2}, "nodes", "at least 1"),
        ({"procs_per_node": 0}, "procs_per_node", "at least 1"),
        ({"nodes": "two"}, "nodes", "integer"),
        ({"max_restarts": -1}, "max_restarts", "at least 0"),
        ({"distribution": "horovod"}, "distribution", "pytorch, deepspeed, mpi, tensorflow"),
        ({"backend": "k8s"}, "backend", "local, ssh, slurm"),
        ({"command": ["/no/such/train.py"]}, "command", "must exist"),
        ({"command": ["python", "missing_script.py"]}, "command", "must exist"),
        ({"command": ["no-such-binary-xyz"]}, "command", "executable on PATH"),
        ({"command": "python train.py; rm -rf /"}, "command", "not a shell string"),
        ({"command": []}, "command", "non-empty list"),
        ({"procs_per_node": 4, "gpus_per_node": 2}, "procs_per_node", "at most the 2 GPU(s)"),
        ({"device": "gpu", "gpus_per_node": 0}, "device", "at least one visible GPU"),
        ({"deepspeed_config": "{}"}, "deepspeed_config", "only allowed with distribution='deepspeed'"),
    ],
)
def test_bad_spec_names_field_value_and_allowed(kwargs, field, fragment):
    kwargs = {"command": OK, **kwargs}
    with pytest.raises(SpecError) as err:
        LaunchSpec(**kwargs)
    assert err.value.field == field
    assert fragment in str(err.value)
    assert repr(err.value.value) in str(err.value) or str(err.value.value) in str(err.value)


def test_ui_strings_are_converted():
    spec = LaunchSpec(command=json.dumps(OK), nodes="2", procs_per_node=" 3 ", max_restarts="1",
                      env='{"A": 1}', distribution="PyTorch", gpus_per_node=0)
    assert (spec.nodes, spec.procs_per_node, spec.max_restarts) == (2, 3, 1)
    assert spec.world_size == 6 and spec.env == {"A": "1"} and spec.distribution == "pytorch"
    assert spec.command == OK


def test_gpu_host_allows_up_to_its_gpus_and_cpu_override():
    assert LaunchSpec(command=OK, procs_per_node=2, gpus_per_node=2).uses_gpu()
    spec = LaunchSpec(command=OK, procs_per_node=8, gpus_per_node=2, device="cpu")
    assert not spec.uses_gpu()


def test_deepspeed_config_not_json(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_batch_size": 8,,}')
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=OK, distribution="deepspeed", deepspeed_config=str(bad))
    assert err.value.field == "deepspeed_config" and "valid JSON" in str(err.value)


def test_deepspeed_config_missing_file():
    with pytest.raises(SpecError, match="existing JSON file"):
        LaunchSpec(command=OK, distribution="deepspeed", deepspeed_config="/nope/ds.json")


def test_deepspeed_batch_mismatch_is_refused():
    config = {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=OK, nodes=2, procs_per_node=2, distribution="deepspeed", deepspeed_config=config)
    assert err.value.field == "deepspeed_config.train_batch_size"
    assert "4 x 2 x 4 = 32" in str(err.value)


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (32, 4, 2)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, (32, 4, 2)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 2)),
        ({"train_batch_size": 16}, (16, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 8}, (32, 8, 1)),
    ],
)
def test_deepspeed_missing_batch_field_is_derived(given, expected):
    config = resolve_deepspeed_config(given, world_size=4)
    got = (config["train_batch_size"], config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"])
    assert got == expected


def test_deepspeed_indivisible_batch_is_refused():
    with pytest.raises(SpecError, match="divisible"):
        resolve_deepspeed_config({"train_batch_size": 10, "gradient_accumulation_steps": 1}, world_size=4)


def test_spec_is_checked_before_any_process_starts(tmp_path):
    # A refused spec must not even create its run directory.
    run_dir = tmp_path / "run"
    with pytest.raises(SpecError):
        LaunchSpec(command=OK, nodes=0, run_dir=str(run_dir))
    assert not run_dir.exists()
