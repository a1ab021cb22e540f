"""A job's secret environment (an Airflow AWS connection's credentials, ``LaunchSpec.secret_env``):
each backend carries it where it carries the rest of the rank environment when that channel is no
argv and no rendered text, Slurm through sbatch's environment instead of its script (the real
job: tests/training/test_dcp_s3_connection.py); a backend not declared to carry it refuses it
before anything is created. The Airflow connection -> AWS variables mapping is one function."""

from __future__ import annotations

import json
import os

import pytest

from dtrain.errors import SpecError
from dtrain.launch.backends import _registered, backend_for, register_backend
from dtrain.launch.backends.local import LocalBackend
from dtrain.launch.core.job import prepare_job
from dtrain.launch.core.spec import LaunchSpec

from ..conftest import script

SECRET = "wJalrXUtnFEMI-secret-value"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": SECRET}
OK = [script("dump_env.py")]


def dryrun(spec: LaunchSpec):
    return backend_for(spec)().dryrun(prepare_job(spec, create=False))


class UncheckedBackend(LocalBackend):
    """A backend whose author did not say where its environment travels (a third-party one)."""

    name = "unchecked"
    carries_secret_env = False


@pytest.fixture
def unchecked_backend(request):
    register_backend(UncheckedBackend.name, UncheckedBackend)
    request.addfinalizer(lambda: _registered.pop(UncheckedBackend.name, None))


def test_a_backend_not_declared_to_carry_credentials_refuses_them_before_anything_is_created(unchecked_backend,
                                                                                            tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=OK, backend="unchecked", secret_env=CREDENTIALS, run_dir=str(run_dir))
    assert err.value.field == "backend" and err.value.value == "unchecked" and "carries_secret_env" in str(err.value)
    assert SECRET not in str(err.value) and not run_dir.exists()
    LaunchSpec(command=OK, backend="unchecked", run_dir=str(run_dir))  # without a secret it runs as before


def test_slurm_keeps_it_out_of_the_sbatch_script():
    spec = LaunchSpec(command=["train.py"], nodes=2, backend="slurm", device="cpu", secret_env=CREDENTIALS,
                      env={"VISIBLE": "1"})
    script = dryrun(spec).render()  # the script written to the run directory and submitted
    assert "export VISIBLE=1" in script and SECRET not in script and "AWS_SECRET_ACCESS_KEY" not in script


def test_a_variable_set_by_both_env_and_the_connection_is_refused_by_name():
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=OK, env={"AWS_SECRET_ACCESS_KEY": "other"}, secret_env=CREDENTIALS)
    assert err.value.field == "env" and err.value.value == ["AWS_SECRET_ACCESS_KEY"] and SECRET not in str(err.value)


def test_local_ranks_get_it_in_their_environment_only():
    spec = LaunchSpec(command=OK, nodes=2, device="cpu", secret_env=CREDENTIALS)
    request = dryrun(spec)
    assert request.env["AWS_SECRET_ACCESS_KEY"] == SECRET  # what submit adds to the agents' environment
    assert SECRET not in request.render() and SECRET not in repr(spec)


@pytest.mark.skipif(not any(os.access(os.path.join(d, "mpirun"), os.X_OK) for d in os.environ["PATH"].split(":")),
                    reason="OpenMPI not installed")
def test_mpirun_forwards_it_by_name_from_its_own_environment():
    spec = LaunchSpec(command=OK, distribution="mpi", procs_per_node=2, device="cpu", secret_env=CREDENTIALS)
    request = dryrun(spec)
    argv = list(request.argvs[0])
    assert argv[argv.index("AWS_SECRET_ACCESS_KEY") - 1] == "-x" and request.env["AWS_SECRET_ACCESS_KEY"] == SECRET
    assert SECRET not in request.render()


def test_ssh_sends_it_on_each_session_stdin_not_in_the_command_line():
    spec = LaunchSpec(command=["train.py"], nodes=2, backend="ssh", device="cpu", secret_env=CREDENTIALS, rdzv_port=29400,
                      backend_options={"hosts": ["a slots=1", "b slots=1"]})
    request = dryrun(spec)
    assert SECRET not in request.render() and not any(SECRET in arg for argv in request.argvs for arg in argv)
    assert [json.loads(line)["env"]["AWS_SECRET_ACCESS_KEY"] for line in request.stdin] == [SECRET, SECRET]


def test_one_mapping_from_the_connection_to_the_aws_variables(monkeypatch):
    from dtrain.preprocess.operator import aws_credentials_env
    from dtrain.hooks.aws import aws_environment

    monkeypatch.setenv("AIRFLOW_CONN_DTRAIN_MAP", json.dumps({
        "conn_type": "aws", "login": "AKIAMAP", "password": SECRET,
        "extra": {"aws_session_token": "tok", "endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-3"}}))
    expected = {"AWS_ACCESS_KEY_ID": "AKIAMAP", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": "tok",
                "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_DEFAULT_REGION": "eu-west-3"}
    assert aws_environment("dtrain_map") == expected
    for name in expected:
        monkeypatch.delenv(name, raising=False)
    with aws_credentials_env("dtrain_map"):  # the preprocess workers' view: the same variables
        assert {name: os.environ.get(name) for name in expected} == expected
    assert not any(name in os.environ for name in expected)
