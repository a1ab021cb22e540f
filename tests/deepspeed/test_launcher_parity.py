"""Parity with the `deepspeed` launcher: per-rank placeholders in the command ({deepspeed_config},
{local_rank}...), --pass-local-rank, LOCAL_SIZE/CROSS_RANK/CROSS_SIZE; and scripts written the way
DeepSpeedExamples' are (ZeRO; pipeline parallel) run unchanged, 1x2 and 2x2, through the CLI and
the operator, on CPU."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from dtrain.errors import SpecError
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.node import placeholders
from dtrain.launch.node.env_contract import deepspeed_launcher_env
from dtrain.launch.node.rank_entry import rank_command
from tests.conftest import REPO, load_test_dag

DTRAIN = os.path.join(os.path.dirname(sys.executable), "dtrain")
SCRIPTS = os.path.join(REPO, "tests", "deepspeed", "scripts")
ENV = {"DTRAIN_DEEPSPEED_CONFIG": "/run/ds.json", "DTRAIN_RUN_DIR": "/run", "DTRAIN_CHECKPOINT_DIR": "/run/ckpt",
       "DTRAIN_METRICS_DIR": "/run/m", "LOCAL_RANK": "1", "RANK": "3", "NODE_RANK": "1", "WORLD_SIZE": "4",
       "LOCAL_WORLD_SIZE": "2"}


def test_placeholders_are_replaced_by_this_ranks_values_and_nothing_else_is():
    command = ["train.py", "--deepspeed_config", "{deepspeed_config}", "--local_rank={local_rank}",
               "--out={run_dir}/r{rank}-of-{world_size}", "{checkpoint_dir}", "{metrics_dir}", "{node_rank}",
               "{local_world_size}"]
    assert rank_command(command, ENV) == [
        "train.py", "--deepspeed_config", "/run/ds.json", "--local_rank=1", "--out=/run/r3-of-4", "/run/ckpt",
        "/run/m", "1", "2"]
    literal = ['{"lr": 1}', "{ rank }", "{rank", "{{rank}}x", "$RANK", "~/x", "{unknown}", "{Rank}"]
    assert rank_command(literal, ENV) == ['{"lr": 1}', "{ rank }", "{rank", "{3}x", "$RANK", "~/x", "{unknown}",
                                          "{Rank}"]
    # A value is never scanned again: a run directory named "{rank}" stays that.
    assert rank_command(["{run_dir}"], {**ENV, "DTRAIN_RUN_DIR": "/r/{rank}"}) == ["/r/{rank}"]
    assert rank_command(["{deepspeed_config}"], {}) == ["{deepspeed_config}"]  # unset: left as written
    assert placeholders.used(command) == {"deepspeed_config", "local_rank", "run_dir", "rank", "world_size",
                                          "checkpoint_dir", "metrics_dir", "node_rank", "local_world_size"}


def test_pass_local_rank_appends_it_as_the_deepspeed_launcher_does():
    assert rank_command(["train.py", "--x"], {**ENV, "DTRAIN_PASS_LOCAL_RANK": "1"}) == [
        "train.py", "--x", "--local_rank=1"]
    assert rank_command(["train.py"], ENV) == ["train.py"]


def test_the_deepspeed_launchers_variables():
    assert deepspeed_launcher_env(ENV) == {"LOCAL_SIZE": "2", "CROSS_RANK": "1", "CROSS_SIZE": "2"}
    assert deepspeed_launcher_env({"RANK": "0"}) == {}


def test_the_config_placeholder_needs_a_config():
    with pytest.raises(SpecError) as info:
        LaunchSpec(command=["python", "-c", "pass", "--deepspeed_config={deepspeed_config}"], procs_per_node=2)
    assert info.value.field == "command[3]"
    assert "only with distribution='deepspeed'" in info.value.allowed


def reports(directory: str) -> dict[int, dict]:
    return {r["rank"]: r for r in (json.load(open(p)) for p in glob.glob(os.path.join(directory, "report-rank*.json")))}


def launch(tmp_path, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([DTRAIN, "launch", "--device", "cpu", "--distribution", "deepspeed", "--pass-local-rank",
                          "--run-dir", str(tmp_path / "run"), *args], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_a_zero_script_in_deepspeedexamples_style_runs_unchanged_from_the_cli(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                  "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                                  "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "steps_per_print": 1000}))
    launch(tmp_path, "--procs-per-node", "2", "--deepspeed-config", str(config), "--",
           "python", os.path.join(SCRIPTS, "ds_zero_style.py"), "--deepspeed", "--deepspeed_config",
           "{deepspeed_config}", "--report-dir", "{run_dir}", "--steps", "2")
    got = reports(str(tmp_path / "run"))
    assert sorted(got) == [0, 1]
    written = str(tmp_path / "run" / "deepspeed_config.json")
    for rank, r in got.items():
        assert r["local_rank_arg"] == r["LOCAL_RANK"] == rank  # args.local_rank, as under `deepspeed`
        assert r["deepspeed_config"] == written  # the validated config, given once
        assert (r["LOCAL_SIZE"], r["CROSS_RANK"], r["CROSS_SIZE"]) == ("2", "0", "1")
        assert (r["zero_stage"], r["train_batch_size"], r["micro"], r["gas"]) == (2, 8, 2, 2)
        assert r["global_steps"] == 2
        # DeepSpeed's shared-memory all-reduce buffer (one node, CPU): used, and gone after the job.
        assert r["shm_buffer_existed"] and not os.path.exists(r["shm_buffer"])
    assert json.load(open(written))["train_batch_size"] == 8  # derived: 2 x 2 x DP 2


def test_a_pipeline_parallel_script_runs_2x2_from_the_cli(tmp_path):
    # 4 ranks, 2 stages: DP 2. 32 = 2 x 8 x 2, with the parallel size declared.
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                                  "gradient_accumulation_steps": 8, "steps_per_print": 1000,
                                  "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}))
    launch(tmp_path, "--nodes", "2", "--procs-per-node", "2", "--pipeline-parallel-size", "2",
           "--deepspeed-config", str(config), "--", "python", os.path.join(SCRIPTS, "ds_pipeline_style.py"),
           "--deepspeed", "--deepspeed_config", "{deepspeed_config}", "--report-dir", "{run_dir}", "--steps", "1")
    got = reports(str(tmp_path / "run"))
    assert sorted(got) == [0, 1, 2, 3]
    assert {r["dp"] for r in got.values()} == {2} and {r["stages"] for r in got.values()} == {2}
    assert sorted(r["stage"] for r in got.values()) == [0, 0, 1, 1]
    assert {(r["train_batch_size"], r["micro"], r["gas"], r["global_steps"]) for r in got.values()} == {(32, 2, 8, 1)}
    assert [got[rank]["local_rank_arg"] for rank in range(4)] == [0, 1, 0, 1]


def test_both_scripts_run_through_the_operator(airflow_db, tmp_path):
    dag = load_test_dag("deepspeed_dags.py", "deepspeed_scripts")
    run = dag.test(run_conf={"out": str(tmp_path)})
    states = {ti.task_id: ti.state for ti in run.get_task_instances()}
    assert states == {"zero_2x2": "success", "pipeline_1x2": "success"}, states
    zero, pipe = reports(str(tmp_path / "zero")), reports(str(tmp_path / "pipeline"))
    assert sorted(zero) == [0, 1, 2, 3] and sorted(pipe) == [0, 1]
    assert [zero[r]["local_rank_arg"] for r in range(4)] == [0, 1, 0, 1]
    assert [zero[r]["CROSS_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert {zero[r]["CROSS_SIZE"] for r in range(4)} == {"2"}
    assert {(r["train_batch_size"], r["micro"], r["gas"]) for r in zero.values()} == {(8, 2, 1)}
    # The config the real deepspeed launcher accepts and the old check refused: 256 = 8 x 32 x DP 1.
    assert {(r["train_batch_size"], r["micro"], r["gas"], r["dp"]) for r in pipe.values()} == {(256, 8, 32, 1)}


def test_the_rank_wrapper_unlinks_only_its_own_regular_shm_buffer(tmp_path):
    from dtrain.launch.node.ds_shm import release_rank as release_shared_memory

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "RANK": "1"}
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29511_"
    mine, other = tmp_path / (prefix + "1"), tmp_path / (prefix + "0")
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    release_shared_memory(env, shm_dir=str(tmp_path))
    assert not mine.exists() and other.exists()  # rank 0's buffer is rank 0's to remove

    target = tmp_path / "precious"
    target.write_bytes(b"x")
    os.symlink(target, mine)  # a planted link under the rank's name: neither followed nor removed
    release_shared_memory(env, shm_dir=str(tmp_path))
    assert mine.is_symlink() and target.exists()
    release_shared_memory({**env, "MASTER_ADDR": "../../etc"}, shm_dir=str(tmp_path))  # no path escapes


def test_the_autotuner_s_experiment_buffers_go_by_their_master_ports(tmp_path):
    from dtrain.launch.node.ds_shm import release_ports

    uid = os.getuid()
    for port in (41000, 41001, 41002):
        for rank in (0, 1):
            (tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_{rank}").write_bytes(b"x")
    assert release_ports([41000, 41001], shm_dir=str(tmp_path)) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_41002_{r}"
                                                          for r in (0, 1)]
