"""DeepSpeed's own autotuner as a pipeline step: what is refused before it runs (and why), the exact
command line, reading a real autotuning_results/ tree (fixtures/: written by DeepSpeed 0.19.8 on
this CPU), and end to end on CPU: the CLI tunes; the operator resumes that tuning (DeepSpeed skips
the experiments whose results exist) and the training task takes the optimal config from XCom."""

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


@pytest.fixture(scope="module")
def cli_tuning(tmp_path_factory):
    """`dtrain autotune` run once for real (DeepSpeed's profiling run and one experiment): its work
    directory, output file and completed process. The CLI test checks it; the operator's test resumes it."""
    root = tmp_path_factory.mktemp("cli-tuning")
    config = root / "ds.json"
    config.write_text(json.dumps(CONFIG))
    output = root / "optimal.json"
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dtrain"), "autotune", "--deepspeed-config",
                          str(config), "--autotuning", json.dumps({**QUICK, "max_train_micro_batch_size_per_gpu": 1,
                                                                   "num_tuning_micro_batch_sizes": 1}),
                          "--procs-per-node", "1", "--device", "cpu", "--work-dir", str(root / "w"),
                          "--output", str(output), "--", "python", ZERO, "--deepspeed", "--deepspeed_config",
                          "{deepspeed_config}", "--steps", "4"], capture_output=True, text=True, timeout=400)
    return root / "w", output, out


#: what DeepSpeed writes once the tuning is over, from its experiments' results
CONCLUSIONS = ("ds_config_optimal.json", "summary.txt", "cmd_optimal.txt")


def test_the_operator_resumes_a_tuning_and_the_training_task_takes_the_optimum_from_xcom(airflow_db, tmp_path,
                                                                                         cli_tuning):
    """The DAG's tuning has ``overwrite: false``: DeepSpeed's autotuner (a real one, started by the operator)
    skips each experiment whose result is in the work directory, here the CLI's (copied without what
    DeepSpeed concludes from them), then writes its conclusions; the training task runs its optimum."""
    work, _, tuned = cli_tuning
    assert tuned.returncode == 0, tuned.stdout[-3000:] + tuned.stderr[-2000:]
    resumed = tmp_path / "autotune"
    shutil.copytree(work / "autotuning_exps", resumed / "autotuning_exps")
    shutil.copytree(work / "autotuning_results", resumed / "autotuning_results",
                    ignore=lambda folder, names: [n for n in names if n in CONCLUSIONS])
    dag = load_test_dag("deepspeed_dags.py", "deepspeed_autotune")
    run = dag.test(run_conf={"out": str(tmp_path)})
    states = {ti.task_id: ti.state for ti in run.get_task_instances()}
    assert states == {"autotune": "success", "train": "success"}, states
    optimal = json.load(open(resumed / "autotuning_results" / "ds_config_optimal.json"))
    assert optimal == json.load(open(work / "autotuning_results" / "ds_config_optimal.json"))
    for experiment in ("profile_model_info", "z0_gas1_tmbspg1"):  # skipped: a rerun would have written anew
        assert (resumed / "autotuning_results" / experiment / "stderr.log").read_bytes() == \
            (work / "autotuning_results" / experiment / "stderr.log").read_bytes(), experiment
    written = json.load(open(tmp_path / "train" / "deepspeed_config.json"))
    assert "autotuning" not in written
    assert {k: written[k] for k in optimal} == optimal  # the training job ran DeepSpeed's optimum
    report = json.load(open(tmp_path / "train" / "report-rank0.json"))
    assert report["micro"] == optimal["train_micro_batch_size_per_gpu"]
    assert report["train_batch_size"] == optimal["train_batch_size"]


def test_deepspeeds_launcher_runs_with_its_scheduler_checking_every_half_second(monkeypatch):
    """dtrain.autotune.ds_runner is DeepSpeed's launcher main with the scheduler's interval (its
    module constant TIMEOUT, 5 s) set to CHECK_INTERVAL_S first, the arguments passed unchanged."""
    import deepspeed.launcher.runner as launcher
    from deepspeed.autotuning import scheduler

    from dtrain.autotune import ds_runner
    from dtrain.autotune.runner import DEEPSPEED

    seen = {}
    monkeypatch.setattr(scheduler, "TIMEOUT", 5)
    monkeypatch.setattr(launcher, "main", lambda args=None: seen.update(args=args, interval=scheduler.TIMEOUT))
    ds_runner.main(["--autotuning", "tune", "--num_gpus", "1", "train.py", "--deepspeed_config", "ds.json"])
    assert seen == {"args": ["--autotuning", "tune", "--num_gpus", "1", "train.py", "--deepspeed_config", "ds.json"],
                    "interval": ds_runner.CHECK_INTERVAL_S} and ds_runner.CHECK_INTERVAL_S < 5
    assert DEEPSPEED == ("-m", ds_runner.__name__)


def test_the_cli_tunes_and_writes_the_optimum(cli_tuning):
    work, output, out = cli_tuning
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    results = work / "autotuning_results"
    assert json.load(open(output)) == json.load(open(results / "ds_config_optimal.json"))
    assert "| global " in out.stdout and "optimal config (z0_gas1_tmbspg1, throughput " in out.stdout
    assert f"[autotune] {sys.executable} -m dtrain.autotune.ds_runner --autotuning tune " in out.stdout
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
    from dtrain.launch.backends import resolve_placement

    def placed(backend, options, nodes, procs, device):
        return device_and_hosts(resolve_placement(nodes=nodes, procs_per_node=procs, backend=backend,
                                                  backend_options=options, device=device))

    assert placed("local", {}, 1, 2, "cpu") == ("cpu", None)  # this host: no hostfile
    hosts = {"hosts": ["10.0.0.1 slots=2", "10.0.0.2 slots=2"]}
    assert placed("ssh", hosts, 2, 2, "cpu") == ("cpu", ["10.0.0.1", "10.0.0.2"])
    with pytest.raises(SpecError) as info:  # Slurm learns its nodes when the job starts
        placed("slurm", {}, 2, 2, "cpu")
    assert info.value.field == "backend"
    with pytest.raises(SpecError) as info:
        placed("ssh", hosts, 3, 2, "cpu")  # fewer hosts than nodes: the ssh backend's own check
    assert info.value.field.startswith("backend_options") or "host" in info.value.allowed


# -- multi-node: DeepSpeed's PDSH runner hands every node one line for its shell ----------------------

HOSTS = {"hosts": ["10.0.0.1", "10.0.0.2"], "nodes": 2}
DUMP = os.path.join(REPO, "tests", "deepspeed", "scripts", "dump_argv.py")
HOSTILE = "x;touch${IFS}PWNED;#"  # a UI param templated into --run-name
#: words the remote grammar allows, each character of it at least once (spaces too: DeepSpeed quotes those)
ALLOWED_WORDS = ["--run-name", "a b", "x=1,y=2", "user@host:/p/a.b+c_d-e", " lead", "trail ", "two  spaces",
                 "--flag=a b", "-", "AZaz09"]


def pdsh_line(script: str, args: list[str], env: dict[str, str], work_dir: str) -> str:
    """The line a node's shell reads, as DeepSpeed 0.19's PDSHRunner builds it (pdsh and ssh join
    their arguments with spaces); DeepSpeed's own launcher module, which the line starts next, is
    replaced by this interpreter, so what the shell made of SCRIPT ARGS is printed instead."""
    import argparse

    from deepspeed.launcher.multinode_runner import PDSHRunner

    runner = PDSHRunner(argparse.Namespace(
        user_args=list(args), user_script=script, ssh_port=None, launcher_args="", master_addr="10.0.0.1",
        master_port=29500, venv_script=None, no_python=False, module=False, no_local_rank=False, save_pid=False,
        enable_each_rank_log="None"), "e30=")
    for key, value in env.items():
        runner.add_export(key, value)
    cwd = os.getcwd()
    os.chdir(work_dir)  # the runner writes `cd <its working directory>;` into the line
    try:
        cmd = runner.get_cmd({}, {"10.0.0.1": [0], "10.0.0.2": [0]})[0]
    finally:
        os.chdir(cwd)
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "10.0.0.1,10.0.0.2"] and cmd[8] == sys.executable, cmd
    exports, cd = cmd[6], cmd[7]
    return " ".join([exports, cd, sys.executable, *cmd[cmd.index(script):]]).replace("%n", "0")


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_the_remote_line_runs_a_hostile_argument_and_reads_allowed_words_verbatim(tmp_path, shell):
    """What the refusal below protects against, with a real shell: the hostile --run-name and env
    value run commands; every word the grammar allows arrives as it was."""
    hostile = pdsh_line(DUMP, ["--run-name", HOSTILE], {"PYTHONDTRAIN_PROBE": "$(touch PWNED2)"}, str(tmp_path))
    subprocess.run([shell, "-c", hostile], cwd=tmp_path, capture_output=True, timeout=60)
    assert (tmp_path / "PWNED").exists() and (tmp_path / "PWNED2").exists()

    value = "a b^c,d=e:f@g+h/i.j_k-l"
    line = pdsh_line(DUMP, ALLOWED_WORDS, {"PYTHONDTRAIN_PROBE": value}, str(tmp_path))
    out = subprocess.run([shell, "-c", line], cwd="/", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"argv": ALLOWED_WORDS, "env": value}
    spec(tmp_path, command=["python", DUMP, *ALLOWED_WORDS], env={"PYTHONDTRAIN_PROBE": value}, **HOSTS)


@pytest.mark.parametrize("kwargs, field", [
    ({"command": ["python", ZERO, "--run-name", HOSTILE]}, "command[3]"),
    ({"command": ["python", ZERO, "--note", "`id`"]}, "command[3]"),
    ({"command": ["python", ZERO, "--lr", "$LR"]}, "command[3]"),
    ({"command": ["python", ZERO, "--tag", "a\nb"]}, "command[3]"),
    ({"command": ["python", ZERO, "--tag", "%n"]}, "command[3]"),
    ({"command": ["python", ZERO, "--tag", ""]}, "command[3]"),
    ({"command": ["python", "/opt/my;job/train.py"]}, "command[1]"),
    ({"env": {"PYTHONDTRAIN_PROBE": "$(touch PWNED2)"}}, "env['PYTHONDTRAIN_PROBE']"),
    ({"env": {"NCCL_DEBUG": 'INFO"; touch x; "'}}, "env['NCCL_DEBUG']"),
    ({"env": {"DS_ENV_FILE": "/etc/passwd"}}, "env"),
    ({"work_dir": "/tmp/a;touch PWNED;b"}, "work_dir"),
])
def test_multi_node_autotuning_refuses_what_the_remote_shell_would_run(tmp_path, kwargs, field):
    with pytest.raises(SpecError) as info:
        spec(tmp_path, **{**HOSTS, **kwargs})
    assert info.value.field == field, info.value
    spec(tmp_path, **kwargs)  # on this host only, experiments start from an argv: no shell, nothing refused


@pytest.mark.parametrize("hosts", [["10.0.0.1", "-oProxyCommand=touch${IFS}x"], ["10.0.0.1", "alice@10.0.0.2"],
                                   ["10.0.0.1", "10.0.0.2:2222"], ["10.0.0.1", "a slots=1\nb"], ["10.0.0.1", ""]])
def test_hosts_follow_the_hostfile_grammar(tmp_path, hosts):
    with pytest.raises(SpecError) as info:
        spec(tmp_path, hosts=hosts, nodes=2)
    assert info.value.field == "hosts[1]", info.value


def test_arg_mappings_values_are_plain_flags(tmp_path):
    with pytest.raises(SpecError) as info:
        autotuning_section({}, {"arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs;touch${IFS}PWNED"}})
    assert info.value.field == "autotuning.arg_mappings"
    assert autotuning_section({}, {"arg_mappings": {"train_micro_batch_size_per_gpu": "--micro-batch_size.x"}})


@pytest.fixture
def reaped(tmp_path):
    """tmp_path; whatever still runs with it in its command line is killed when the test ends (an
    autotuner that was not refused runs DeepSpeed in its own session, out of the CLI's reach)."""
    yield tmp_path
    import psutil

    from tests.support import kill_survivors

    mine = []
    for proc in psutil.process_iter():
        try:
            if str(tmp_path) in " ".join(proc.cmdline()):
                mine.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    kill_survivors(mine, timeout=0)


def test_the_cli_refuses_a_hostile_argument_or_host_before_anything_is_created(reaped):
    tmp_path = reaped
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(CONFIG))
    base = [os.path.join(os.path.dirname(sys.executable), "dtrain"), "autotune", "--deepspeed-config", str(config),
            "--device", "cpu", "--work-dir", str(tmp_path / "w"), "--nodes", "2"]
    out = subprocess.run([*base, "--hosts", "127.0.0.1,127.0.0.2", "--", "python", ZERO, "--run-name", HOSTILE],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"command[3]={HOSTILE!r} is invalid" in out.stderr, out.stderr
    out = subprocess.run([*base, "--hosts", "127.0.0.1,-oProxyCommand=x", "--", "python", ZERO],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "hosts[1]='-oProxyCommand=x' is invalid" in out.stderr, out.stderr
    assert not (tmp_path / "w").exists()


def test_the_config_and_hostfile_replace_planted_links_never_write_through_them(reaped):
    """A rank of an earlier run (experiments run in the work dir) left links where the runner writes."""
    tmp_path = reaped
    from dtrain.autotune.results import AutotuneError
    from dtrain.autotune.runner import run_autotune

    work, victim = tmp_path / "w", tmp_path / "victim"
    work.mkdir()
    victim.write_text("precious\n")
    for name in ("ds_config_autotune.json", "hostfile"):
        os.symlink(victim, work / name)
    one = spec(tmp_path, work_dir=str(work), hosts=["127.0.0.1"])
    with pytest.raises(AutotuneError):  # DeepSpeed's ssh check of 127.0.0.1 fails: nothing is tuned
        run_autotune(one, sink=lambda line: None)
    assert victim.read_text() == "precious\n"
    config, hostfile = work / "ds_config_autotune.json", work / "hostfile"
    assert not os.path.islink(config) and json.loads(config.read_text()) == one.config
    assert not os.path.islink(hostfile) and hostfile.read_text() == "127.0.0.1 slots=1\n"


def test_results_with_links_directories_or_junk_in_place_of_files_are_read_as_missing(tmp_path):
    tree = tmp_path / "autotuning_results"
    shutil.copytree(FIXTURE, tree)
    victim = tmp_path / "victim.json"
    victim.write_text(json.dumps({"throughput": 1e9}))
    os.unlink(tree / "z0_gas1_tmbspg3" / "metrics.json")
    os.symlink(victim, tree / "z0_gas1_tmbspg3" / "metrics.json")  # a link: not read
    os.unlink(tree / "z0_gas1_tmbspg4" / "metrics.json")
    (tree / "z0_gas1_tmbspg4" / "metrics.json").mkdir()  # a directory: not read, no crash
    (tree / "z0_gas2_tmbspg2" / "metrics.json").write_text("[1, 2]")  # JSON, not an object
    os.unlink(tree / "z0_gas1_tmbspg1" / "stderr.log")
    os.mkfifo(tree / "z0_gas1_tmbspg1" / "stderr.log")  # would block a plain open()
    names = {e["name"]: e for e in read_results(str(tree))["experiments"]}
    assert {n: names[n]["metric"] for n in ("z0_gas1_tmbspg3", "z0_gas1_tmbspg4", "z0_gas2_tmbspg2")} == dict.fromkeys(
        ("z0_gas1_tmbspg3", "z0_gas1_tmbspg4", "z0_gas2_tmbspg2"))
    assert names["z0_gas1_tmbspg1"]["status"] == "ok"
