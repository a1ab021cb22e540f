"""DistributedTrainingOperator: a thin Airflow operator over the launch engine.

Declarative at parse time: ``__init__`` stores arguments and does no I/O and no
validation of templated values; ``execute`` renders, converts and validates them
(so Params typed in the UI work), launches, streams every rank's output into the
task log, and returns the result through XCom. ``on_kill`` tears down every rank.
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

from airflow.configuration import conf
from airflow.sdk import BaseOperator

from dtrain.launch.job import dtrain_home
from dtrain.links import LINKS


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", part)


class DistributedTrainingOperator(BaseOperator):
    """Run a training command on ``nodes`` x ``procs_per_node`` ranks with the env contract.

    Args:
        command: argv run on every rank (templated; no shell).
        nodes: number of nodes (templated; strings from Params are converted).
        procs_per_node: processes per node (templated).
        distribution: ``pytorch`` | ``deepspeed`` | ``mpi`` | ``tensorflow`` (templated).
        backend: a registered backend (``local`` | ``ssh`` | ``slurm`` | ``mpi`` | an installed one; templated).
        backend_options: ``{backend name: that backend's options}`` (templated); the chosen backend's
            section is used, e.g. ``{"ssh": {"conn_id": "gpu_hosts"}, "slurm": {"partition": "gpu"}}``.
            ``ssh``: ``hostfile`` or ``hosts`` (DeepSpeed ``host slots=N`` lines, optionally
            ``user@host:port``), ``conn_id`` (an Airflow SSH connection giving them), ``user``, ``port``,
            ``key_file``, ``known_hosts_file``, ``strict_host_key_checking``, ``connect_timeout``,
            ``python``. ``slurm``: the fields of :class:`dtrain.launch.backends.slurm.SlurmOptions`.
        env: extra environment for every rank (templated).
        deepspeed_config: DeepSpeed JSON config path or dict (templated), validated before launch.
        max_restarts: torchrun worker restarts after a failure.
        run_dir: checkpoints/metrics directory (templated). Default
            ``$DTRAIN_HOME/runs/<dag_id>/<run_id>/<task_id>``, so an Airflow retry of the same
            run resumes from its checkpoint and other runs never share it.
        device, gpus_per_node, rdzv_timeout, workdir: as in :class:`dtrain.launch.spec.LaunchSpec`.
        mpi_options: distribution ``mpi``: extra mpirun options (allow-listed).
        parameter_servers: distribution ``tensorflow``: how many ranks are ``ps`` tasks.
        deferrable: submit the job, then wait in the triggerer instead of a worker slot (backends
            whose jobs outlive the worker: ssh, slurm; see dtrain.launch.deferrable). Default:
            Airflow's ``[operators] default_deferrable``, as the providers do.
    """

    template_fields: Sequence[str] = (
        "command", "nodes", "procs_per_node", "distribution", "env", "deepspeed_config", "run_dir",
        "max_restarts", "backend", "backend_options", "mpi_options",
    )
    template_fields_renderers = {"env": "json", "deepspeed_config": "json", "command": "py", "backend_options": "json"}
    ui_color = "#d7e9f7"
    operator_extra_links = tuple(LINKS)  # checkpoints, metrics, TensorBoard (operators/dtrain/links.py)

    def __init__(
        self,
        *,
        command: Sequence[str] | str,
        nodes: int | str = 1,
        procs_per_node: int | str = 1,
        distribution: str = "pytorch",
        backend: str = "local",
        backend_options: dict[str, dict[str, Any]] | str | None = None,
        env: dict[str, str] | None = None,
        deepspeed_config: str | dict | None = None,
        max_restarts: int | str = 0,
        run_dir: str | None = None,
        device: str = "auto",
        gpus_per_node: int | None = None,
        rdzv_timeout: float = 300.0,
        workdir: str | None = None,
        mpi_options: Sequence[str] | str | None = None,
        parameter_servers: int = 0,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.command = command
        self.nodes = nodes
        self.procs_per_node = procs_per_node
        self.distribution = distribution
        self.backend = backend
        self.backend_options = backend_options or {}
        self.env = env or {}
        self.deepspeed_config = deepspeed_config
        self.max_restarts = max_restarts
        self.run_dir = run_dir
        self.device = device
        self.gpus_per_node = gpus_per_node
        self.rdzv_timeout = rdzv_timeout
        self.workdir = workdir
        self.mpi_options = mpi_options
        self.parameter_servers = parameter_servers
        self.deferrable = deferrable
        self._launcher = None
        self.last_result: dict[str, Any] | None = None  # read by the extra links after success

    def default_run_dir(self, context) -> str:
        run_id = context["run_id"] if "run_id" in context else "manual"
        return os.path.join(dtrain_home(), "runs", _safe(self.dag_id), _safe(run_id), _safe(self.task_id))

    def build_spec(self, context):
        from dtrain.launch.backends import options_for
        from dtrain.launch.spec import LaunchSpec

        backend = str(self.backend).strip().lower()
        return LaunchSpec(
            command=self.command, nodes=self.nodes, procs_per_node=self.procs_per_node,
            distribution=self.distribution, backend=backend, env=self.env,
            deepspeed_config=self.deepspeed_config or None, max_restarts=self.max_restarts,
            run_dir=self.run_dir or self.default_run_dir(context), device=self.device,
            gpus_per_node=self.gpus_per_node, rdzv_timeout=self.rdzv_timeout, workdir=self.workdir,
            mpi_options=self.mpi_options or None, parameter_servers=self.parameter_servers,
            backend_options=options_for(backend, self.backend_options),
        )

    def execute(self, context) -> dict[str, Any]:
        from dtrain.launch.launcher import Launcher

        spec = self.build_spec(context)  # raises SpecError before anything starts
        if self.deferrable:
            from dtrain.launch.deferrable import defer_job

            return defer_job(self, spec, context)
        self._launcher = Launcher(spec, sink=self.log.info)
        result = self._launcher.run()
        result.raise_for_status()
        self.log.info("world_size=%s duration=%.1fs checkpoints=%s metrics=%s",
                      result.world_size, result.duration_s, result.checkpoint_dir, result.metrics)
        self.last_result = result.to_xcom()
        return self.last_result

    def on_kill(self) -> None:
        if self._launcher is not None:
            self.log.info("on_kill: stopping every rank of job %s", getattr(self._launcher.job, "job_id", "?"))
            self._launcher.terminate()
        from dtrain.launch.deferrable import kill_job

        kill_job(self)  # a job submitted in deferrable mode: cancel it on every host

    def execute_complete(self, context, event: dict[str, Any] | None = None) -> dict[str, Any]:
        """Resumed by the trigger's event (deferrable mode): raise with the log tail on failure."""
        from dtrain.launch.deferrable import resume_job

        self.last_result = resume_job(self, event)
        return self.last_result
