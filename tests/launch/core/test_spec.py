"""Bad specs are refused before anything starts, with an error naming field, value and what is allowed."""

from __future__ import annotations

import json

import pytest

from dtrain.errors import SpecError
from dtrain.launch.core.deepspeed_config import resolve_deepspeed_config
from dtrain.launch.core.spec import LaunchSpec

from tests.launch.conftest import script

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


@pytest.mark.parametrize("distribution", ["tensorflow", "mpi"])
def test_a_distribution_the_backend_cannot_serve_is_refused_at_validate(tmp_path, distribution):
    """Slurm starts torchrun agents only, and a TF cluster needs node addresses that exist only once its job
    runs: it used to accept both and start torchrun without TF_CONFIG (or without mpirun)."""
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=["train.py"], nodes=2, backend="slurm", device="cpu", distribution=distribution,
                   run_dir=str(tmp_path / "run"))
    assert (err.value.field, err.value.value) == ("distribution", distribution)
    assert "one of pytorch, deepspeed on backend 'slurm'" in str(err.value)
    assert not (tmp_path / "run").exists()


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
    assert "4 x 2 x one of [1, 2, 4] = one of 8, 16, 32" in str(err.value)


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


HOSTILE_ENV_KEYS = ["$(touch /tmp/dtrain-pwned)X", "BAD KEY", "1X", "A\nB", "A=B", "", "X\0", "ÄX", "X;Y", "X\n"]
CONTRACT_KEYS = ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                 "DTRAIN_RUN_DIR", "DTRAIN_JOB_ID", "PET_NODE_RANK", "SLURM_NODEID", "OMPI_COMM_WORLD_RANK",
                 "TORCHELASTIC_RESTART_COUNT"]


@pytest.mark.parametrize("key", HOSTILE_ENV_KEYS)
def test_env_keys_follow_the_shell_grammar(key):
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=OK, env={key: "1"})
    assert err.value.field == "env key" and "^[A-Za-z_][A-Za-z0-9_]*$" in err.value.allowed


@pytest.mark.parametrize("key", CONTRACT_KEYS)
def test_contract_variables_cannot_be_overridden(key):
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=OK, env={key: "7"})
    assert err.value.field == "env key" and "does not set itself" in err.value.allowed


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", float("nan"), 0.5, 0, -1, "1e12", "soon"])
def test_rdzv_timeout_is_a_finite_number_of_seconds(value):
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=OK, rdzv_timeout=value)
    assert err.value.field == "rdzv_timeout"


@pytest.mark.parametrize("value, expected", [("2.0", 2), (2.0, 2), (" 3 ", 3)])
def test_integral_floats_from_rendered_params_are_converted(value, expected):
    assert LaunchSpec(command=OK, nodes=value).nodes == expected


@pytest.mark.parametrize("value", ["2.5", 2.5, "nan", float("inf"), True])
def test_non_integral_node_counts_are_refused(value):
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=OK, nodes=value)
    assert err.value.field == "nodes"


def test_a_deeply_nested_deepspeed_config_is_refused_without_recursion(tmp_path):
    deep = "{\"a\": " * 100_000 + "1" + "}" * 100_000
    path = tmp_path / "ds.json"
    path.write_text(deep)
    for value in (deep, str(path)):
        with pytest.raises(SpecError) as err:
            resolve_deepspeed_config(value, 1)
        assert err.value.field == "deepspeed_config" and "levels of nesting" in err.value.allowed
    nested: dict = {"train_batch_size": 1}
    node = nested
    for _ in range(1000):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(SpecError, match="levels of nesting"):
        resolve_deepspeed_config(nested, 1)
    strings = '{"train_batch_size": 1, "note": "' + "[{" * 1000 + '"}'  # brackets inside a string do not nest
    assert resolve_deepspeed_config(strings, 1)["train_batch_size"] == 1


@pytest.mark.parametrize("argv, field", [
    (["--env", "$(touch {p})X=1"], "env key"),
    (["--env", "NODE_RANK=5"], "env key"),
    (["--rdzv-timeout", "nan"], "rdzv_timeout"),
    (["--rdzv-timeout", "0.5"], "rdzv_timeout"),
    (["--backend", "slurm", "--env", "A\nB=1"], "env key"),
])
def test_cli_refuses_bad_input_with_exit_2_before_creating_anything(tmp_path, argv, field):
    import os
    import subprocess
    import sys

    pwned, run_dir = tmp_path / "pwned", tmp_path / "run"
    argv = [a.format(p=pwned) for a in argv]
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dtrain"), "launch", *argv,
                           "--run-dir", str(run_dir), "--", *OK], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"{field}=" in proc.stderr and "Traceback" not in proc.stderr
    assert not run_dir.exists() and not pwned.exists()


def test_validate_keeps_typed_options_on_the_spec_and_never_rewrites_backend_options(tmp_path, monkeypatch):
    """Each value crosses the layer once: the backend resolves its options at validate and the rest of it
    reads the typed value (spec.resolved). ssh and slurm used to write their normalised form back into
    backend_options, and ssh parsed its settings again from there at each use."""
    from dtrain.launch.backends.slurm.render import SlurmOptions
    from dtrain.launch.backends.ssh.hostfile import SSHPlacement, SSHSettings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("a slots=2\nb slots=2\n")
    given = {"hostfile": "hosts", "user": "train", "connect_timeout": "7"}
    spec = LaunchSpec(command=["train.py"], backend="ssh", nodes=2, procs_per_node=2, backend_options=dict(given))
    assert spec.backend_options == given
    assert isinstance(spec.resolved, SSHPlacement) and [h.host for h in spec.resolved.hosts] == ["a", "b"]
    assert isinstance(spec.resolved.settings, SSHSettings) and spec.resolved.settings.user == "train"
    assert spec.resolved.settings.connect_timeout == 7

    given = {"partition": "gpu", "extra_sbatch": "--mem=8G"}
    spec = LaunchSpec(command=["train.py"], backend="slurm", nodes=2, backend_options=dict(given))
    assert spec.backend_options == given
    assert isinstance(spec.resolved, SlurmOptions) and spec.resolved.partition == "gpu"


def test_the_registry_resolves_a_placement_and_the_spec_keeps_what_it_resolved():
    """A Placement is a plain value: the backend registry checks it against the backend's class
    (resolve_placement), once; a spec built from flat keywords holds that resolved placement."""
    from dtrain.launch.backends import Placement, resolve_placement

    assert Placement(nodes=0, backend="nope").nodes == 0  # no check of its own
    with pytest.raises(SpecError) as e:
        resolve_placement(nodes=2, backend="nope")
    assert (e.value.field, e.value.value) == ("backend", "nope")
    with pytest.raises(SpecError) as e:
        resolve_placement(nodes="2:4", backend="mpi")
    assert (e.value.field, e.value.value) == ("nodes", "2:4") and "a fixed count on backend 'mpi'" in e.value.allowed
    placement = resolve_placement(nodes=" 2:4 ", procs_per_node="3", backend=" LOCAL ", device="cpu")
    assert (placement.nodes, placement.min_nodes, placement.procs_per_node, placement.backend) == (4, 2, 3, "local")
    assert placement.resolved == {}

    spec = LaunchSpec(command=["true"], nodes=2, device="cpu")
    assert spec.placement == resolve_placement(nodes=2, device="cpu")
    assert LaunchSpec(command=["true"], placement=spec.placement).placement is spec.placement
    # the spec holds the placement, no copy: its keywords read it back, read-only; the repr is unchanged
    assert (spec.nodes, spec.backend, spec.backend_options) == (2, "local", spec.placement.options)
    with pytest.raises(AttributeError):
        spec.nodes = 3
    # the fields in the options table's order, the placement's keywords in their places
    assert repr(spec).startswith("LaunchSpec(command=['true'], nodes=2, procs_per_node=1, distribution='pytorch', "
                                 "backend='local', deepspeed_config=None, ")
    assert repr(spec).endswith(", env={}, mpi_options=None, parameter_servers=0, backend_options={}, workdir=None, "
                               "job_id=None, min_nodes=None)")
