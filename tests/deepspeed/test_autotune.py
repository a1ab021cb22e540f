"""DeepSpeed's own autotuner as a pipeline step: what is refused before it runs (and why), the exact
command line, reading a real autotuning_results/ tree (fixtures/: written by DeepSpeed 0.19.8 on
this CPU), and end to end on CPU: the operator tunes, the training task takes the optimal config
from XCom; and the CLI."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from dtrain.autotune.results import AutotuneError, parse_summary, read_results
from dtrain.autotune.runner import AutotuneSpec, autotune_env, autotuning_section, build_argv, hostfile_text
from dtrain.errors import SpecError
from tests.conftest import REPO, load_test_dag

FIXTURE = os.path.join(REPO, "tests", "deepspeed", "fixtures", "autotuning_results")
ZERO = os.path.join(REPO, "tests", "deepspeed", "scripts", "ds_zero_style.py")
CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
          "zero_allow_untested_optimizer": True, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
QUICK = {"start_profile_step": 1, "end_profile_step": 2, "max_train_micro_batch_size_per_gpu": 2,
         "num_tuning_micro_batch_sizes": 2, "tuner_num_trials": 2}


def test_the_users_section_is_kept_enabled_and_fast():
    section = autotuning_section({"autotuning": {"metric": "throughput", "tuner_type": "random"}},
                                 {"tuner_num_trials": 10.0, "end_profile_step": 8})
    assert section == {"metric": "throughput", "tuner_type": "random", "tuner_num_trials": 10,
                       "end_profile_step": 8, "enabled": True, "fast": True}


@pytest.mark.parametrize("section, field, allowed_starts", [
    ({"metric": "latency"}, "autotuning.metric", "throughput: DeepSpeed 0.19 maximizes the metric"),
    ({"fast": False}, "autotuning.fast", "true: DeepSpeed 0.19's full search writes experiments without a hostfile"),
    ({"model_info": {"num_params": 10}}, "autotuning.model_info", "one of "),
    ({"results_dir": "/etc"}, "autotuning.results_dir", "one of "),
    ({"tuner_type": "bayes"}, "autotuning.tuner_type", "gridsearch, random or model_based"),
    ({"start_profile_step": 5, "end_profile_step": 5}, "autotuning.end_profile_step", "above start_profile_step"),
    ({"tuner_num_trials": 0}, "autotuning.tuner_num_trials", ""),
    ({"arg_mappings": {"train_micro_batch_size_per_gpu": "; rm -rf /"}}, "autotuning.arg_mappings", "a mapping"),
])
def test_what_deepspeed_0_19_cannot_do_is_refused_before_anything_runs(section, field, allowed_starts):
    with pytest.raises(SpecError) as info:
        autotuning_section({}, section)
    assert info.value.field == field and info.value.allowed.startswith(allowed_starts), info.value.allowed


def spec(tmp_path, **kwargs) -> AutotuneSpec:
    return AutotuneSpec(**{"command": ["python", ZERO, "--deepspeed", "--deepspeed_config", "{deepspeed_config}"],
                           "deepspeed_config": CONFIG, "autotuning": QUICK, "work_dir": str(tmp_path), **kwargs})


def test_the_command_line_and_the_hostfile(tmp_path):
    one = spec(tmp_path, procs_per_node=2)
    assert build_argv(one, "/w/ds.json", "/w/no-hostfile", 29600) == [
        "deepspeed", "--autotuning", "tune", "--hostfile", "/w/no-hostfile", "--num_nodes", "1", "--num_gpus", "2",
        "--master_port", "29600", ZERO, "--deepspeed", "--deepspeed_config", "/w/ds.json"]
    bare = spec(tmp_path, command=[ZERO, "--epochs", "1"])  # no placeholder: the flag is appended
    assert build_argv(bare, "/w/ds.json", "/w/h", 1)[-4:] == ["--epochs", "1", "--deepspeed_config", "/w/ds.json"]
    two = spec(tmp_path, nodes=2, procs_per_node=8, hosts=["gpu-1", "gpu-2"], device="gpu")
    assert hostfile_text(two.hosts, two.procs_per_node) == "gpu-1 slots=8\ngpu-2 slots=8\n"
    env = autotune_env(spec(tmp_path, procs_per_node=2), environ={"PATH": "/usr/bin"})
    assert (env["DS_ACCELERATOR"], env["LOCAL_SIZE"]) == ("cpu", "2")  # the CPU accelerator's slots
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)  # experiments run `deepspeed`
    assert "DS_ACCELERATOR" not in autotune_env(two, environ={})
    with pytest.raises(SpecError) as info:
        spec(tmp_path, command=["python", "-m", "pkg.train"])
    assert info.value.field == "command"
    with pytest.raises(SpecError) as info:
        spec(tmp_path, nodes=2)
    assert info.value.field == "nodes"


def test_results_are_read_from_a_real_tree():
    result = read_results(FIXTURE)
    assert result["best_experiment"] == "z0_gas1_tmbspg1" and result["best_metric_value"] == 1248.68
    assert result["optimal_config"] == {
        "gradient_accumulation_steps": 1, "optimizer": {"params": {"lr": 0.01}, "type": "SGD"}, "steps_per_print": 1000,
        "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 0}}
    assert [r["tuning_space"] for r in result["summary"]] == ["z0", "global"]
    assert result["summary"][0] == {"tuning_space": "z0", "num_experiments": 5, "best_metric_val": 1248.68,
                                    "best_exp_name": "z0_gas1_tmbspg1"}
    names = {e["name"]: e for e in result["experiments"]}
    assert set(names) == {"profile_model_info", "z0_gas1_tmbspg1", "z0_gas1_tmbspg3", "z0_gas1_tmbspg4",
                          "z0_gas2_tmbspg2"}
    assert all(e["status"] == "ok" for e in result["experiments"])
    assert names["z0_gas1_tmbspg1"]["metric"] == pytest.approx(1248.68, abs=0.01)  # metrics.json, unrounded
    assert result["cmd_optimal"].startswith("deepspeed --hostfile ")
    assert parse_summary("no table") == []


def test_no_optimum_fails_naming_the_experiments_and_their_errors(tmp_path):
    tree = tmp_path / "autotuning_results"
    shutil.copytree(FIXTURE, tree)
    for name in ("ds_config_optimal.json", "summary.txt", "cmd_optimal.txt"):
        os.unlink(tree / name)
    (tree / "profile_model_info" / "stderr.log").write_text("AssertionError: You are using an untested ZeRO "
                                                           "Optimizer\n")
    with pytest.raises(AutotuneError, match="profile_model_info: AssertionError: You are using an untested ZeRO"):
        read_results(str(tree))
    with pytest.raises(AutotuneError, match="did not start"):
        read_results(str(tmp_path / "nothing"))


def test_the_operator_tunes_and_the_training_task_takes_the_optimum_from_xcom(airflow_db, tmp_path):
    dag = load_test_dag("deepspeed_dags.py", "deepspeed_autotune")
    run = dag.test(run_conf={"out": str(tmp_path)})
    states = {ti.task_id: ti.state for ti in run.get_task_instances()}
    assert states == {"autotune": "success", "train": "success"}, states
    optimal = json.load(open(tmp_path / "autotune" / "autotuning_results" / "ds_config_optimal.json"))
    written = json.load(open(tmp_path / "train" / "deepspeed_config.json"))
    assert "autotuning" not in written
    assert {k: written[k] for k in optimal} == optimal  # the training job ran DeepSpeed's optimum
    report = json.load(open(tmp_path / "train" / "report-rank0.json"))
    assert report["micro"] == optimal["train_micro_batch_size_per_gpu"]
    assert report["train_batch_size"] == optimal["train_batch_size"]


def test_the_cli_tunes_and_writes_the_optimum(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(CONFIG))
    output = tmp_path / "optimal.json"
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dtrain"), "autotune", "--deepspeed-config",
                          str(config), "--autotuning", json.dumps({**QUICK, "max_train_micro_batch_size_per_gpu": 1,
                                                                   "num_tuning_micro_batch_sizes": 1}),
                          "--procs-per-node", "1", "--device", "cpu", "--work-dir", str(tmp_path / "w"),
                          "--output", str(output), "--", "python", ZERO, "--deepspeed", "--deepspeed_config",
                          "{deepspeed_config}", "--steps", "4"], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    results = tmp_path / "w" / "autotuning_results"
    assert json.load(open(output)) == json.load(open(results / "ds_config_optimal.json"))
    assert "| global " in out.stdout and "optimal config (z0_gas1_tmbspg1, throughput " in out.stdout
    # DeepSpeed's CPU all-reduce left a 67 MB /dev/shm buffer per experiment; the runner removed them.
    from dtrain.autotune.results import experiment_ports

    ports = experiment_ports(str(results))
    assert len(ports) >= 2, ports  # the profiling run and at least one tuning experiment
    assert [p for port in ports for p in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")] == []


def test_the_cli_reports_bad_input_with_exit_2(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**CONFIG, "autotuning": {"metric": "latency"}}))
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dtrain"), "autotune", "--deepspeed-config",
                          str(config), "--work-dir", str(tmp_path / "w"), "--", "python", ZERO],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "autotuning.metric='latency' is invalid: throughput" in out.stderr, out.stderr
    assert not (tmp_path / "w").exists()  # refused before anything was created


def test_the_nodes_come_from_the_backend_registry():
    from dtrain.autotune.shape import device_and_hosts

    assert device_and_hosts("local", {}, 1, 2, "cpu") == ("cpu", None)  # this host: no hostfile
    hosts = {"hosts": ["10.0.0.1 slots=2", "10.0.0.2 slots=2"]}
    assert device_and_hosts("ssh", hosts, 2, 2, "cpu") == ("cpu", ["10.0.0.1", "10.0.0.2"])
    with pytest.raises(SpecError) as info:  # Slurm learns its nodes when the job starts
        device_and_hosts("slurm", {}, 2, 2, "cpu")
    assert info.value.field == "backend"
    with pytest.raises(SpecError) as info:
        device_and_hosts("ssh", hosts, 3, 2, "cpu")  # fewer hosts than nodes: the ssh backend's own check
    assert info.value.field.startswith("backend_options") or "host" in info.value.allowed
