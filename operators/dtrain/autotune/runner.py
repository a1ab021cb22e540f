"""Run DeepSpeed's own autotuner (``deepspeed --autotuning tune``) on a job's nodes, then read its results.

Pure parts first (:class:`AutotuneSpec` validation, :func:`autotuning_section`, :func:`build_argv`,
:func:`hostfile_text`), I/O last (:func:`run_autotune`). What DeepSpeed 0.19's autotuner needs,
found by running it (docs/deepspeed.md has the details):

* the script takes ``--deepspeed_config FILE`` (deepspeed.add_config_arguments) and runs at least
  ``end_profile_step + 1`` steps; experiments are started as ``deepspeed ...`` by name, so the
  environment's ``bin`` is put first on PATH;
* ``fast`` must stay true (the full search writes experiments without a hostfile and fails),
  ``metric`` must be ``throughput`` (the scheduler always maximizes: ``latency`` would pick the
  slowest run, ``flops`` fails on a missing key), and ``model_info`` must not be set (it skips
  the profiling run, then crashes). These are refused here, with the reason, before anything runs;
* on CPU (``DS_ACCELERATOR=cpu``) each node's slot count is ``LOCAL_SIZE``; the runner exits 0
  even when every experiment failed, so success is judged from ``ds_config_optimal.json``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from dtrain import grammar
from dtrain.args import coerce_argv, coerce_int
from dtrain.errors import SpecError

RESULTS_DIR, EXPS_DIR = "autotuning_results", "autotuning_exps"
#: what the runner writes into the work dir: the config DeepSpeed varies, and the hostfile (or the
#: name of a file that does not exist, which DeepSpeed reads as "this host only")
CONFIG_FILE, HOSTFILE, NO_HOSTFILE = "ds_config_autotune.json", "hostfile", "no-hostfile"
CONFIG_PLACEHOLDER = "{deepspeed_config}"
#: keys of the autotuning section a user may set (deepspeed/autotuning/constants.py)
ALLOWED = {
    "enabled": "true (forced)", "fast": "true (forced: false fails in DeepSpeed 0.19)",
    "metric": "throughput", "tuner_type": "gridsearch, random or model_based (needs xgboost)",
    "tuner_num_trials": "a positive integer", "tuner_early_stopping": "a positive integer",
    "start_profile_step": "a positive integer", "end_profile_step": "an integer above start_profile_step",
    "max_train_batch_size": "a positive integer", "min_train_batch_size": "a positive integer",
    "max_train_micro_batch_size_per_gpu": "a positive integer", "min_train_micro_batch_size_per_gpu":
        "a positive integer", "num_tuning_micro_batch_sizes": "a positive integer", "mp_size": "a positive integer",
    "overwrite": "true or false", "arg_mappings": "a mapping of config keys to the script's flags",
}
INTEGER_KEYS = {k for k, v in ALLOWED.items() if "integer" in v}
TUNERS = ("gridsearch", "random", "model_based")


def autotuning_section(config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The checked ``autotuning`` section: the config's, updated with ``overrides``, enabled and fast."""
    section = dict(config.get("autotuning") or {})
    section.update(overrides or {})
    for key, value in section.items():
        field_name = f"autotuning.{key}"
        if key not in ALLOWED:
            why = {"model_info": "it skips DeepSpeed's profiling run, which then fails",
                   "results_dir": "dtrain chooses it (the job's run directory)",
                   "exps_dir": "dtrain chooses it (the job's run directory)"}.get(key, "not an autotuning option")
            raise SpecError(field_name, value, f"one of {', '.join(sorted(ALLOWED))} ({key}: {why})")
        if key in INTEGER_KEYS:
            section[key] = coerce_int(field_name, value, minimum=1)
    if section.get("fast", True) is not True:
        raise SpecError("autotuning.fast", section["fast"], "true: DeepSpeed 0.19's full search writes experiments "
                                                           "without a hostfile and every one fails")
    if section.get("metric", "throughput") != "throughput":
        raise SpecError("autotuning.metric", section["metric"], "throughput: DeepSpeed 0.19 maximizes the metric, so "
                                                               "latency would pick the slowest configuration")
    if section.get("tuner_type", "gridsearch") not in TUNERS:
        raise SpecError("autotuning.tuner_type", section["tuner_type"], ALLOWED["tuner_type"])
    start, end = section.get("start_profile_step", 3), section.get("end_profile_step", 5)
    if end <= start:
        raise SpecError("autotuning.end_profile_step", end, f"above start_profile_step ({start})")
    if not isinstance(section.get("overwrite", True), bool):
        raise SpecError("autotuning.overwrite", section["overwrite"], "true or false")
    mappings = section.get("arg_mappings")
    # DeepSpeed inserts each flag into every experiment's argv, which a remote shell reads (see REMOTE_ARG).
    if mappings is not None and (not isinstance(mappings, Mapping)
                                 or not all(isinstance(k, str) and isinstance(v, str) and grammar.FLAG.fullmatch(v)
                                            for k, v in mappings.items())):
        raise SpecError("autotuning.arg_mappings", mappings,
                        ALLOWED["arg_mappings"] + f" (--flag values matching {grammar.FLAG.pattern})")
    section.update(enabled=True, fast=True)
    return section


@dataclass
class AutotuneSpec:
    """One autotuning run.

    Args:
        command: the training command, ``[python,] script.py [args...]``; ``{deepspeed_config}``
            in it becomes the config file (else ``--deepspeed_config FILE`` is appended).
        deepspeed_config: the user's DeepSpeed config (path, JSON text or mapping), with or
            without an ``autotuning`` section.
        autotuning: autotuning options that override the config's section (metric, tuner_type,
            tuner_num_trials, start_profile_step, end_profile_step, ...).
        nodes, procs_per_node: the job's shape (slots per node: GPUs, or CPU ranks).
        hosts: the nodes' addresses for a multi-node run (a DeepSpeed hostfile is written); None: this host.
            DeepSpeed then starts experiments through pdsh, whose remote shell reads the command as
            one line: every argument, the work dir and env values must then be words that shell
            reads verbatim (:data:`dtrain.grammar.REMOTE_ARG`), or the spec is refused.
        work_dir: where the config, ``autotuning_results/`` and ``autotuning_exps/`` go (made absolute).
        device: ``cpu`` runs DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``), ``gpu`` its default.
        env: extra environment for the autotuner and its experiments.
    """

    command: Sequence[str]
    deepspeed_config: str | Mapping[str, Any]
    work_dir: str
    autotuning: Mapping[str, Any] | None = None
    nodes: int = 1
    procs_per_node: int = 1
    hosts: Sequence[str] | None = None
    device: str = "cpu"
    env: Mapping[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from dtrain.launch.core.deepspeed_config import load_deepspeed_config

        self.command = coerce_argv("command", self.command)
        script = self.command[1] if self.command[0] in ("python", "python3", sys.executable) and \
            len(self.command) > 1 else self.command[0]
        if not script.endswith(".py"):
            raise SpecError("command", self.command[:2], "[python] SCRIPT.py ARGS: DeepSpeed's autotuner launches a "
                                                         "script file (not -m or an executable)")
        self.nodes = coerce_int("nodes", self.nodes, minimum=1, maximum=grammar.MAX_NODES)
        self.procs_per_node = coerce_int("procs_per_node", self.procs_per_node, minimum=1, maximum=1024)
        if self.device not in ("cpu", "gpu"):
            raise SpecError("device", self.device, "cpu or gpu")
        if not isinstance(self.work_dir, str) or not self.work_dir.strip() or "\0" in self.work_dir:
            raise SpecError("work_dir", self.work_dir, "a directory path")
        self.work_dir = os.path.abspath(self.work_dir)
        if self.hosts is not None:
            self.hosts = [hostfile_host(f"hosts[{i}]", host) for i, host in enumerate(self.hosts)]
            if len(self.hosts) != self.nodes:
                raise SpecError("hosts", self.hosts, f"exactly nodes={self.nodes} host addresses")
        if self.hosts is None and self.nodes > 1:
            raise SpecError("nodes", self.nodes, "1 without hosts (more nodes need their addresses: backend ssh)")
        config = load_deepspeed_config(self.deepspeed_config)
        config["autotuning"] = autotuning_section(config, self.autotuning)
        self.config = config
        if self.hosts is not None:
            check_remote_words(self)

    @property
    def script_and_args(self) -> list[str]:
        command = list(self.command)
        return command[1:] if command[0] in ("python", "python3", sys.executable) else command

    @property
    def config_path(self) -> str:
        return os.path.join(self.work_dir, CONFIG_FILE)

    @property
    def hostfile(self) -> str:
        return os.path.join(self.work_dir, HOSTFILE if self.hosts else NO_HOSTFILE)


def hostfile_host(field_name: str, host: Any) -> str:
    """One node address, by the hostfile grammar (dtrain.grammar.HOST_TARGET), without the
    ``user@`` and ``:port`` that DeepSpeed's hostfile and pdsh's host list cannot carry."""
    match = grammar.HOST_TARGET.match(host) if isinstance(host, str) else None
    if match is None or match.group("user") is not None or match.group("port") is not None:
        raise SpecError(field_name, host, "a host name or IPv4 address as in a hostfile, without user@ or :port "
                                          "(set those in ~/.ssh/config: DeepSpeed reaches the nodes with pdsh)")
    return match.group("host")


def check_remote_words(spec: AutotuneSpec) -> None:
    """Refuse what a remote shell would read as code when DeepSpeed starts experiments on the hosts.

    DeepSpeed 0.19's PDSH runner sends each node ``export K="V"; cd WORK_DIR; python -u -m
    deepspeed.launcher.launch ... SCRIPT ARGS`` as one line for the remote shell, quoting only an
    argument with a space (in double quotes, escaping nothing but ``"``): ``--run-name
    'x;touch${IFS}PWNED;#'`` would run ``touch`` on every node. So each such word must be one the
    shell reads verbatim."""
    # The remote shell runs `cd <the autotuner's working directory>` as the kernel names it (links
    # resolved), and the config path under the work dir is an argument.
    for path in (spec.work_dir, os.path.realpath(spec.work_dir)):
        grammar.check("work_dir", path, grammar.PLAIN_PATH, f"with hosts, a path matching {grammar.PLAIN_PATH.pattern} "
                                                            f"(also once links are resolved): DeepSpeed sends "
                                                            f"`cd WORK_DIR` unquoted to a remote shell")
    for i, arg in enumerate(spec.command):
        if grammar.REMOTE_ARG.fullmatch(arg.replace(CONFIG_PLACEHOLDER, spec.config_path)) is None:
            raise SpecError(f"command[{i}]", arg, f"with hosts, words of {grammar.REMOTE_ARG.pattern} only: DeepSpeed "
                                                  f"sends the command to a remote shell as one line, unquoted")
    for key, value in spec.env.items():
        if key == "DS_ENV_FILE":
            raise SpecError("env", key, "not DS_ENV_FILE: DeepSpeed would export that file's lines on every node")
        grammar.check(f"env[{key!r}]", value, grammar.REMOTE_ENV_VALUE,
                      f"with hosts, a value matching {grammar.REMOTE_ENV_VALUE.pattern}: DeepSpeed writes "
                      f"`export {key}=\"VALUE\"` unescaped into a remote shell line")


def hostfile_text(hosts: Sequence[str], slots: int) -> str:
    """DeepSpeed's hostfile: one ``host slots=N`` line per node."""
    return "".join(f"{host} slots={slots}\n" for host in hosts)


def user_args(spec: AutotuneSpec, config_path: str) -> list[str]:
    """The script and its arguments as DeepSpeed gets them: ``{deepspeed_config}`` is the config
    file (else ``--deepspeed_config FILE`` is appended)."""
    args = spec.script_and_args
    if any(CONFIG_PLACEHOLDER in a for a in args):
        return [a.replace(CONFIG_PLACEHOLDER, config_path) for a in args]
    return [*args, "--deepspeed_config", config_path]


#: DeepSpeed's launcher as the runner starts it: with its scheduler's checks every half second
#: (:mod:`dtrain.autotune.ds_runner`), after this interpreter
DEEPSPEED = ("-m", "dtrain.autotune.ds_runner")


def build_argv(spec: AutotuneSpec, config_path: str, hostfile: str, master_port: int,
               deepspeed: Sequence[str] = ("deepspeed",)) -> list[str]:
    """The ``deepspeed --autotuning tune`` command line (argv, no shell)."""
    return [*deepspeed, "--autotuning", "tune", "--hostfile", hostfile, "--num_nodes", str(spec.nodes),
            "--num_gpus", str(spec.procs_per_node), "--master_port", str(master_port),
            *user_args(spec, config_path)]


def autotune_env(spec: AutotuneSpec, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    env.update(spec.env)
    bin_dir = os.path.dirname(sys.executable)  # experiments run `deepspeed` by name
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    if spec.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["LOCAL_SIZE"] = str(spec.procs_per_node)  # the CPU accelerator's slots per node
    env.update(mlflow_parent_run(spec.work_dir, env))
    return env


def mlflow_parent_run(work_dir: str, env: Mapping[str, str]) -> dict[str, str]:
    """DeepSpeed's autotuner (0.19) logs to MLflow whenever ``mlflow`` is importable, and then reads
    ``MLFLOW_RUN_ID`` unconditionally (a KeyError, zero experiments, when it is not set). When mlflow
    is installed and no run is given, make one: in the user's tracking server when
    ``MLFLOW_TRACKING_URI`` is set, else in a SQLite store in the work dir."""
    import importlib.util

    if "MLFLOW_RUN_ID" in env or importlib.util.find_spec("mlflow") is None:
        return {}
    extra = {} if env.get("MLFLOW_TRACKING_URI") else {"MLFLOW_TRACKING_URI": "sqlite:///" + os.path.join(
        os.path.abspath(work_dir), "mlflow.db")}  # MLflow 3 refuses a new file store
    made = subprocess.run([sys.executable, "-c", "import mlflow; print(mlflow.start_run().info.run_id)"],
                          env={**env, **extra}, capture_output=True, text=True, timeout=300)
    run_id = made.stdout.strip().splitlines()[-1] if made.returncode == 0 and made.stdout.strip() else ""
    if not run_id:
        raise RuntimeError(f"could not create the MLflow run DeepSpeed's autotuner needs: {made.stderr[-1000:]}")
    return {**extra, "MLFLOW_RUN_ID": run_id}


def release_experiment_buffers(results_dir: str) -> None:
    """The experiments' DeepSpeed shm buffers (see dtrain.launch.node.ds_shm), by the master port each
    experiment recorded in its exp.json (the autotuner gives experiment k the port + k)."""
    from dtrain.autotune.results import experiment_ports
    from dtrain.launch.node.ds_shm import release_ports

    release_ports(experiment_ports(results_dir))


def write_inputs(spec: AutotuneSpec) -> None:
    """The work dir, the config and the hostfile, written as a run directory is (dtrain.rundir: the
    experiments' code runs there too): no link followed, temp file + rename. A work dir that
    cannot be made is bad input (SpecError), not a traceback."""
    from dtrain.rundir import RunDir, UnsafeRunDir

    work = RunDir(spec.work_dir)
    try:
        work.ensure_dir()
    except (OSError, UnsafeRunDir) as e:
        raise SpecError("work_dir", spec.work_dir, f"a directory this user can create or use ({e})") from e
    work.write_json(CONFIG_FILE, value=spec.config, indent=2)
    # Without hosts, NO_HOSTFILE stays missing: DeepSpeed reads that as "this host only" (never /job/hostfile).
    if spec.hosts:
        work.write(HOSTFILE, data=hostfile_text(spec.hosts, spec.procs_per_node).encode())


def run_autotune(spec: AutotuneSpec, sink: Callable[[str], None] = print,
                 started: Callable[[subprocess.Popen], None] | None = None) -> dict[str, Any]:
    """Write the config (and hostfile), run DeepSpeed's autotuner in ``work_dir``, return its results."""
    from dtrain.autotune.results import read_results
    from dtrain.launch.node.net import free_port

    write_inputs(spec)
    argv = build_argv(spec, spec.config_path, spec.hostfile, free_port(), (sys.executable, *DEEPSPEED))
    sink("[autotune] " + " ".join(argv))
    proc = subprocess.Popen(argv, cwd=spec.work_dir, env=autotune_env(spec), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    if started is not None:
        started(proc)
    try:
        for raw in proc.stdout:
            sink("[autotune] " + raw.decode("utf-8", "replace").rstrip())
        code = proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        release_experiment_buffers(os.path.join(spec.work_dir, RESULTS_DIR))
    result = read_results(os.path.join(spec.work_dir, RESULTS_DIR))
    result["exit_code"] = code
    return result
