"""The launch spec: a validated, pure description of one distributed training job.

Imports neither Airflow nor torch, so the CLI, the operator, tests and other
orchestrators share it. Every check runs in ``__post_init__``: a bad value is
refused before any process starts, with a :class:`SpecError` that names the
field, the value and what is allowed. Values may arrive as strings (rendered
Airflow templates, UI Params); they are converted here.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from dtrain.args import coerce_argv, coerce_env
from dtrain.errors import SpecError
from dtrain.launch.backends import backend_for, get_backend_class, resolve_placement, runner_for
from dtrain.launch.core.deepspeed_config import resolve_deepspeed_config
from dtrain.launch.backends.placement import Placement
from dtrain.launch.core.spec_options import DISTRIBUTIONS, JOB_OPTIONS, PLACEMENT_OPTIONS

__all__ = ["DISTRIBUTIONS", "JOB_OPTIONS", "LaunchSpec", "check_distribution", "script_of"]
PYTHON_NAMES = ("python", "python3")
#: the spec's placement keywords, read back from :attr:`LaunchSpec.placement` (``backend_options``: its options)
PLACEMENT_KEYWORDS = {"nodes": "nodes", "procs_per_node": "procs_per_node", "backend": "backend",
                      "device": "device", "gpus_per_node": "gpus_per_node", "backend_options": "options",
                      "min_nodes": "min_nodes"}


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


@dataclass(repr=False)
@JOB_OPTIONS.fields(init_only=PLACEMENT_OPTIONS)
class LaunchSpec:
    """What to run, on how many nodes and processes, with which distribution.

    Every field but ``command``, ``secret_env`` and ``placement`` is an option declared in
    :data:`~dtrain.launch.core.spec_options.JOB_OPTIONS`, a keyword-only field made from its line there,
    where the CLI's flags, the operator's parameters and the per-field checks come from too.
    The placement (nodes, procs_per_node, backend, backend_options, device, gpus_per_node) is a
    :class:`~dtrain.launch.backends.placement.Placement` the spec holds (:attr:`placement`): give its
    keywords (resolved once, by the backend registry's :func:`~dtrain.launch.backends.resolve_placement`),
    or ``placement=`` one already resolved (an operator's). ``spec.nodes`` and the other placement
    keywords read the placement back (read-only).

    Args:
        command: argv run on every rank (no shell; arguments reach it verbatim).
            ``train.py args`` runs with this Python; ``python -m pkg.mod`` works too.
        nodes: number of nodes (simulated nodes for the local backend), or ``"MIN:MAX"``: an elastic
            job (local, ssh and slurm backends, distribution pytorch) that starts on up to MAX nodes, goes on
            at a smaller world size when nodes are lost while MIN are left, and grows back when they
            return (docs/elastic.md). ``nodes`` is then MAX, ``min_nodes`` MIN.
        procs_per_node: worker processes per node (GPUs per node on GPU hosts).
        distribution: ``pytorch`` (DDP via torchrun), ``deepspeed``, ``mpi`` or ``tensorflow``.
        backend: a registered backend: ``local`` (nodes simulated on this host), ``ssh``,
            ``slurm``, ``mpi``, or one installed through the ``dtrain.backends`` entry points.
        backend_options: the backend's own options (validated by the backend), e.g. for
            ``ssh`` ``{"hostfile": "hosts.txt", "user": "alice"}``, for ``slurm``
            ``{"partition": "gpu", "time_limit": "4:00:00"}``; see each backend's ``option_names``.
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
        mpi_options: distribution ``mpi``: extra mpirun options, e.g. ``["-x NCCL_DEBUG=VERSION"]``,
            checked against an allow-list (nothing that makes mpirun run another program).
        parameter_servers: distribution ``tensorflow``: how many of the ranks are ``ps`` tasks
            in TF_CONFIG (legacy TF 1.x); the others are workers.
        hang_timeout: seconds a rank may go without progress (a line printed, a metrics record,
            a ``heartbeat()``) before the job is declared hung: every rank's stack is dumped,
            the job torn down, and the launch fails with exit code 124; None turns it off.
        stop_grace: seconds a rank has, after SIGTERM (a stop, a preemption), to save a
            checkpoint and exit before it is killed.
        model_parallel_size, pipeline_parallel_size: distribution ``deepspeed``: the tensor and
            pipeline parallel sizes the script uses, when it splits the model; the data-parallel
            size (world size / both) is what DeepSpeed's batch arithmetic uses.
        pass_local_rank: append ``--local_rank=N`` to every rank's command, as the ``deepspeed``
            launcher does (for scripts that read ``args.local_rank``).
        secret_env: environment for every rank that is a secret (an Airflow connection's AWS
            credentials): given to the ranks as ``env`` is, never shown in the spec's repr; a backend
            that would write it into an argv, a script or the dry-run output refuses it.
        placement: a resolved :class:`~dtrain.launch.backends.placement.Placement` (see above).
    """

    command: Sequence[str]
    # every option of JOB_OPTIONS is a keyword-only field here (JOB_OPTIONS.fields), the placement's an InitVar
    secret_env: Mapping[str, str] = field(default_factory=dict, repr=False, kw_only=True)
    placement: Placement | None = field(default=None, repr=False, kw_only=True)
    resolved_deepspeed_config: dict[str, Any] | None = field(default=None, init=False, repr=False)

    def __post_init__(self, nodes: Any, procs_per_node: Any, backend: Any, device: Any, gpus_per_node: Any,
                      backend_options: Any) -> None:
        self.command = coerce_argv("command", self.command)
        if self.placement is None:
            self.placement = resolve_placement(nodes=nodes, procs_per_node=procs_per_node, backend=backend,
                                               backend_options=backend_options, device=device,
                                               gpus_per_node=gpus_per_node)
        placement = self.placement
        self.distribution = check_distribution(placement, self.distribution)
        backend_cls = get_backend_class(placement.backend)
        self.env = JOB_OPTIONS.check("env", self.env)
        self.secret_env = coerce_env("secret_env", self.secret_env)  # messages name keys, never values
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise SpecError("env", both, "no variable the connection's credentials set (aws_conn_id)")
        for name in ("job_id", "rdzv_port", "rdzv_timeout", "max_restarts", "hang_timeout", "stop_grace"):
            setattr(self, name, JOB_OPTIONS.check(name, getattr(self, name)))
        if self.workdir is not None and not os.path.isdir(self.workdir):
            raise SpecError("workdir", self.workdir, "an existing directory")
        self._check_command(backend_cls.single_host)
        self._check_distribution_options()
        runner = backend_for(self)
        self._check_secret_env_carried({backend_cls, runner})
        backend_cls.validate(self)
        if runner is not backend_cls:  # e.g. distribution='mpi' on the ssh hosts: mpirun's checks too
            runner.validate(self)
        if self.deepspeed_config is not None and self.distribution != "deepspeed":
            raise SpecError("deepspeed_config", self.deepspeed_config, "only allowed with distribution='deepspeed'")
        for name in ("model_parallel_size", "pipeline_parallel_size", "pass_local_rank"):
            setattr(self, name, JOB_OPTIONS.check(name, getattr(self, name)))
        if self.distribution == "deepspeed":
            self.resolved_deepspeed_config = resolve_deepspeed_config(
                self.deepspeed_config, self.world_size, self.model_parallel_size, self.pipeline_parallel_size)
        elif self.model_parallel_size * self.pipeline_parallel_size > 1:
            raise SpecError("model_parallel_size x pipeline_parallel_size",
                            self.model_parallel_size * self.pipeline_parallel_size,
                            "1 unless distribution='deepspeed' (they only enter DeepSpeed's batch arithmetic)")
        self._check_placeholders()
        self._check_elastic()

    @property
    def world_size(self) -> int:
        """Ranks on all nodes (an elastic job's at its most)."""
        return self.placement.world_size

    @property
    def elastic(self) -> bool:
        return self.placement.elastic

    def _check_elastic(self) -> None:
        """What an elastic job cannot have: a world size fixed in its distribution's settings."""
        if not self.elastic:
            return
        if self.distribution != "pytorch":
            raise SpecError("distribution", self.distribution, "pytorch for an elastic job (nodes=MIN:MAX): "
                                                               "DeepSpeed's batch arithmetic and TF_CONFIG fix the world size")


    @property
    def resolved(self) -> Any:
        """What the backend resolved from its options, typed (the placement's)."""
        return self.placement.resolved

    def uses_gpu(self) -> bool:
        return self.placement.uses_gpu()

    def _check_secret_env_carried(self, backends) -> None:
        for cls in backends:
            if self.secret_env and not cls.carries_secret_env:
                raise SpecError("backend", cls.name, "a backend that carries credentials (aws_conn_id) to the ranks "
                                                     "outside every argv, script and file (its carries_secret_env)")

    def _check_distribution_options(self) -> None:
        if self.mpi_options is not None and self.distribution != "mpi":
            raise SpecError("mpi_options", self.mpi_options, "only used with distribution='mpi'")
        self.parameter_servers = JOB_OPTIONS.check("parameter_servers", self.parameter_servers)
        if self.parameter_servers:
            if self.distribution != "tensorflow":
                raise SpecError("parameter_servers", self.parameter_servers, "only used with distribution='tensorflow'")
            if self.parameter_servers >= self.world_size:
                raise SpecError("parameter_servers", self.parameter_servers,
                                f"fewer than the {self.world_size} processes (at least one worker)")

    def _check_command(self, on_this_host: bool) -> None:
        # Remote hosts have their own filesystems: only a backend running here can check paths.
        if not on_this_host:
            return
        base = self.workdir or os.getcwd()
        script = script_of(self.command)
        if script is not None:
            path = script if os.path.isabs(script) else os.path.join(base, script)
            if not os.path.isfile(path):
                raise SpecError("command", script, f"the script must exist (looked for {path})")
        elif shutil.which(self.command[0]) is None:
            raise SpecError("command", self.command[0], "an executable on PATH or an existing .py script")

    def _check_placeholders(self) -> None:
        from dtrain.launch.node import placeholders

        if "deepspeed_config" in placeholders.used(self.command) and self.distribution != "deepspeed":
            index = next(i for i, arg in enumerate(self.command) if "{deepspeed_config}" in arg)
            raise SpecError(f"command[{index}]", self.command[index],
                            "{deepspeed_config} only with distribution='deepspeed' (there is no config otherwise)")

    def __repr__(self) -> str:
        """The fields as a dataclass shows them, the placement's in their keywords' places (its MIN last)."""
        shown = [name for name, f in self.__dataclass_fields__.items() if f.repr] + ["min_nodes"]
        return f"{type(self).__qualname__}({', '.join(f'{name}={getattr(self, name)!r}' for name in shown)})"


def _placement_property(attribute: str) -> property:
    return property(lambda spec: getattr(spec.placement, attribute),
                    doc=f"``placement.{attribute}``, read-only (the spec holds the placement, not a copy)")


# The placement's keywords are the constructor's (InitVar), resolved once into ``placement``; reading one
# back (spec.nodes) reads the placement: callers outside dtrain and tests still read them so.
for _keyword, _attribute in PLACEMENT_KEYWORDS.items():
    setattr(LaunchSpec, _keyword, _placement_property(_attribute))


def check_distribution(placement: Placement, distribution: Any) -> str:
    """``distribution`` converted and checked against the backend that would run it on ``placement``
    (the named one, or the one it hands the distribution to: local and ssh hand mpi to mpirun)."""
    name = JOB_OPTIONS.check("distribution", distribution)
    runner = runner_for(placement.backend, name)
    if name not in runner.distributions:
        raise SpecError("distribution", name,
                        f"one of {', '.join(runner.distributions)} on backend {placement.backend!r}")
    return name
