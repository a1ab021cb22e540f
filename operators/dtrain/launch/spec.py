"""The launch spec: a validated, pure description of one distributed training job.

Imports neither Airflow nor torch, so the CLI, the operator, tests and other
orchestrators share it. Every check runs in ``__post_init__``: a bad value is
refused before any process starts, with a :class:`SpecError` that names the
field, the value and what is allowed. Values may arrive as strings (rendered
Airflow templates, UI Params); they are converted here.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from operators.args import mapping_arg
from operators.errors import SpecError
from operators.launch.deepspeed_config import resolve_deepspeed_config

DISTRIBUTIONS = ("pytorch", "deepspeed", "mpi", "tensorflow")
BACKENDS = ("local", "ssh", "slurm")
DEVICES = ("auto", "cpu", "gpu")
PYTHON_NAMES = ("python", "python3")


def coerce_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Convert ``value`` (an int or a string of digits from a template) to int, within bounds."""
    if isinstance(value, bool):
        raise SpecError(name, value, "an integer is required, not a boolean")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text)
        except ValueError as e:
            raise SpecError(name, text, "an integer is required") from e
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise SpecError(name, value, "an integer is required")
    if minimum is not None and value < minimum:
        raise SpecError(name, value, f"must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise SpecError(name, value, f"must be at most {maximum}")
    return value


def coerce_float(name: str, value: Any, *, minimum: float = 0.0) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError) as e:
        raise SpecError(name, value, "a number is required") from e
    if number <= minimum:
        raise SpecError(name, value, f"must be greater than {minimum}")
    return number


def coerce_argv(name: str, value: Any) -> list[str]:
    """An argv list. A string is accepted only as a JSON array (how a rendered list may arrive).

    A plain string is refused rather than split: commands never pass through a shell.
    """
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text) if text.startswith("[") else None
        except json.JSONDecodeError as e:
            raise SpecError(name, text, "a list of strings (argv) is required; a JSON array string is accepted") from e
        if value is None:
            raise SpecError(name, text, "a list of strings (argv) is required, not a shell string")
    if not isinstance(value, (list, tuple)) or not value:
        raise SpecError(name, value, "a non-empty list of strings (argv) is required")
    argv = []
    for item in value:
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            item = str(item)
        if not isinstance(item, str):
            raise SpecError(name, value, "every argv item must be a string")
        argv.append(item)
    return argv


def coerce_env(name: str, value: Any) -> dict[str, str]:
    value = mapping_arg(name, value, not_json="a mapping of strings (or a JSON object string) is required",
                        not_mapping="a mapping of variable name to string is required")
    env = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise SpecError(f"{name} key", key, "a variable name without '=' or NUL")
        env[key] = str(item)
    return env


def visible_gpu_count() -> int:
    """GPUs on this host, without importing torch: the NVIDIA driver's /proc entries,
    narrowed by CUDA_VISIBLE_DEVICES as CUDA would."""
    try:
        count = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        count = min(count, len(ids))
    return count


def script_of(command: Sequence[str]) -> str | None:
    """The Python script a command runs, when it runs one (``train.py ...`` or ``python train.py ...``)."""
    first = command[0]
    if first.endswith(".py"):
        return first
    if os.path.basename(first).startswith(PYTHON_NAMES) and len(command) > 1:
        nxt = command[1]
        if nxt.endswith(".py") and not nxt.startswith("-"):
            return nxt
    return None


@dataclass
class LaunchSpec:
    """What to run, on how many nodes and processes, with which distribution.

    Args:
        command: argv run on every rank (no shell; arguments reach it verbatim).
            ``train.py args`` runs with this Python; ``python -m pkg.mod`` works too.
        nodes: number of nodes (simulated nodes for the local backend).
        procs_per_node: worker processes per node (GPUs per node on GPU hosts).
        distribution: ``pytorch`` (DDP via torchrun), ``deepspeed``, ``mpi`` or ``tensorflow``.
        backend: ``local`` (nodes simulated on this host), ``ssh`` or ``slurm``.
        env: extra environment for every rank.
        rdzv_port: rendezvous port; 0 picks a free port per job so concurrent jobs never collide.
        rdzv_timeout: seconds every node has to join the rendezvous.
        max_restarts: how often torchrun restarts the workers after a failure.
        deepspeed_config: path to a DeepSpeed JSON config, or the config as a dict;
            validated against the world size, written to the run directory, path
            handed to the script as ``DTRAIN_DEEPSPEED_CONFIG``.
        device: ``auto`` (GPU if the host has one), ``cpu`` or ``gpu``.
        gpus_per_node: GPUs each node has; ``None`` detects this host's (local backend).
        run_dir: where checkpoints, metrics and rank exit records go; default a fresh
            directory under ``$DTRAIN_HOME`` (``~/.dtrain``)/runs.
        job_id: rendezvous id and run name; default generated.
        workdir: working directory of every rank; default the current directory.
        hostfile: backend ``ssh``: path of a hostfile (DeepSpeed's ``host slots=N`` lines, optionally
            ``user@host:port``; see operators/launch/hostfile.py). The first ``nodes`` hosts run
            the job, node rank in line order; each needs ``slots >= procs_per_node``.
        hosts: backend ``ssh``: the same lines given inline (a list, or one string of lines or commas).
        ssh: backend ``ssh``: SSH settings (user, port, key_file, known_hosts_file,
            strict_host_key_checking, connect_timeout, python); see ``SSHSettings``.
        mpi_options: distribution ``mpi``: extra mpirun options, e.g. ``["-x NCCL_DEBUG=VERSION"]``,
            checked against an allow-list (nothing that makes mpirun run another program).
        parameter_servers: distribution ``tensorflow``: how many of the ranks are ``ps`` tasks
            in TF_CONFIG (legacy TF 1.x); the others are workers.
    """

    command: Sequence[str]
    nodes: int = 1
    procs_per_node: int = 1
    distribution: str = "pytorch"
    backend: str = "local"
    env: Mapping[str, str] = field(default_factory=dict)
    rdzv_port: int = 0
    rdzv_timeout: float = 300.0
    max_restarts: int = 0
    deepspeed_config: str | Mapping[str, Any] | None = None
    device: str = "auto"
    gpus_per_node: int | None = None
    run_dir: str | None = None
    job_id: str | None = None
    workdir: str | None = None
    hostfile: str | None = None
    hosts: Sequence[str] | str | None = None
    ssh: Mapping[str, Any] | None = None
    mpi_options: Sequence[str] | str | None = None
    parameter_servers: int = 0
    resolved_deepspeed_config: dict[str, Any] | None = field(default=None, init=False, repr=False)
    resolved_hosts: list[Any] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.command = coerce_argv("command", self.command)
        self.nodes = coerce_int("nodes", self.nodes, minimum=1, maximum=4096)
        self.procs_per_node = coerce_int("procs_per_node", self.procs_per_node, minimum=1, maximum=1024)
        self.distribution = str(self.distribution).strip().lower()
        if self.distribution not in DISTRIBUTIONS:
            raise SpecError("distribution", self.distribution, f"one of {', '.join(DISTRIBUTIONS)}")
        self.backend = str(self.backend).strip().lower()
        if self.backend not in BACKENDS:
            raise SpecError("backend", self.backend, f"one of {', '.join(BACKENDS)}")
        self.env = coerce_env("env", self.env)
        self.rdzv_port = coerce_int("rdzv_port", self.rdzv_port, minimum=0, maximum=65535)
        self.rdzv_timeout = coerce_float("rdzv_timeout", self.rdzv_timeout)
        self.max_restarts = coerce_int("max_restarts", self.max_restarts, minimum=0, maximum=100)
        self.device = str(self.device).strip().lower()
        if self.device not in DEVICES:
            raise SpecError("device", self.device, f"one of {', '.join(DEVICES)}")
        if self.gpus_per_node is not None:
            self.gpus_per_node = coerce_int("gpus_per_node", self.gpus_per_node, minimum=0)
        if self.workdir is not None and not os.path.isdir(self.workdir):
            raise SpecError("workdir", self.workdir, "an existing directory")
        self._check_command()
        self._check_gpus()
        from operators.launch.hostfile import check_remote_fields  # hosts, ssh, mpi and TF options

        check_remote_fields(self)
        if self.deepspeed_config is not None and self.distribution != "deepspeed":
            raise SpecError("deepspeed_config", self.deepspeed_config, "only allowed with distribution='deepspeed'")
        if self.distribution == "deepspeed":
            self.resolved_deepspeed_config = resolve_deepspeed_config(self.deepspeed_config, self.world_size)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def uses_gpu(self) -> bool:
        if self.device == "cpu":
            return False
        if self.device == "gpu":
            return True
        return self.gpu_capacity() > 0

    def gpu_capacity(self) -> int:
        return visible_gpu_count() if self.gpus_per_node is None else self.gpus_per_node

    def _check_command(self) -> None:
        # Remote hosts have their own filesystems: only the local backend can check paths here.
        if self.backend != "local":
            return
        base = self.workdir or os.getcwd()
        script = script_of(self.command)
        if script is not None:
            path = script if os.path.isabs(script) else os.path.join(base, script)
            if not os.path.isfile(path):
                raise SpecError("command", script, f"the script must exist (looked for {path})")
        elif shutil.which(self.command[0]) is None:
            raise SpecError("command", self.command[0], "an executable on PATH or an existing .py script")

    def _check_gpus(self) -> None:
        # This host's GPUs say nothing about remote nodes: count them only for the local
        # backend, unless the user stated gpus_per_node.
        if self.backend != "local" and self.gpus_per_node is None:
            return
        capacity = self.gpu_capacity()
        if self.device == "gpu" and capacity == 0:
            raise SpecError("device", "gpu", "a host with at least one visible GPU (none found)")
        if capacity > 0 and self.device != "cpu" and self.procs_per_node > capacity:
            raise SpecError(
                "procs_per_node",
                self.procs_per_node,
                f"at most the {capacity} GPU(s) per node on this host (use device='cpu' to run on CPU)",
            )
