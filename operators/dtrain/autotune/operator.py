"""DeepSpeedAutotuneOperator: DeepSpeed's own autotuner as a task, its optimal config in XCom.

    autotune = DeepSpeedAutotuneOperator(
        task_id="autotune", command=["python", "train.py", "--deepspeed", "--deepspeed_config", "{deepspeed_config}"],
        deepspeed_config="/fsx/ds.json", autotuning={"tuner_num_trials": 20, "end_profile_step": 8},
        nodes=1, procs_per_node=8)
    train = DistributedTrainingOperator(
        task_id="train", distribution="deepspeed", command=[...same...],
        deepspeed_config="{{ ti.xcom_pull(task_ids='autotune')['optimal_config'] | tojson }}", ...)
    autotune >> train

Thin over :mod:`dtrain.autotune.runner`; ``__init__`` does no I/O and nothing heavy is imported
at parse time.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Sequence

from airflow.sdk import BaseOperator

from dtrain.launch.airflow.placement_args import PLACEMENT_FIELDS, PlacementArgs


class DeepSpeedAutotuneOperator(PlacementArgs, BaseOperator):
    """Run ``deepspeed --autotuning tune`` for a training command; return the optimal config.

    Args:
        command: the training command (``[python] script.py args``; ``{deepspeed_config}`` is the
            config file DeepSpeed's autotuner varies). Templated.
        deepspeed_config: the DeepSpeed config (path or dict), with or without an ``autotuning`` section. Templated.
        autotuning: options for that section (metric, tuner_type, tuner_num_trials,
            tuner_early_stopping, start_profile_step, end_profile_step, max/min batch sizes...). Templated.
        nodes, procs_per_node: the shape of the training job (slots per node: its GPUs).
        backend: ``local`` (this worker) or ``ssh`` (the hosts of ``backend_options``; DeepSpeed
            then reaches them itself, with pdsh and passwordless ssh, as its launcher always does).
        backend_options: as for DistributedTrainingOperator (for ssh: hosts, hostfile or conn_id).
        device: ``auto`` (GPU when this host has one), ``cpu`` or ``gpu``.
        work_dir: where results go (default ``$DTRAIN_HOME/autotune/<dag_id>/<run_id>/<task_id>``).
        env: extra environment for the autotuner and its experiments.

    Returns (XCom): optimal_config (ds_config_optimal.json), best_experiment, best_metric_value,
    summary (the table's rows), cmd_optimal, experiments (name, status, throughput), results_dir.
    """

    template_fields: Sequence[str] = ("command", "deepspeed_config", "autotuning", *PLACEMENT_FIELDS, "work_dir",
                                      "env")
    template_fields_renderers = {"deepspeed_config": "json", "autotuning": "json", "command": "py", "env": "json"}
    ui_color = "#f3e5f5"

    def __init__(self, *, command: Sequence[str], deepspeed_config: str | dict, autotuning: dict | None = None,
                 nodes: int | str = 1, procs_per_node: int | str = 1, backend: str = "local",
                 backend_options: dict | None = None, device: str = "auto", work_dir: str | None = None,
                 env: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.command, self.deepspeed_config, self.autotuning = command, deepspeed_config, autotuning
        self.init_placement(nodes=nodes, procs_per_node=procs_per_node, backend=backend,
                            backend_options=backend_options, device=device)
        self.work_dir, self.env = work_dir, env or {}
        self._proc = None

    def _work_dir(self, context) -> str:
        from dtrain.paths import dtrain_home, safe_part

        run_id = context["run_id"] if "run_id" in context else "manual"
        return os.path.join(dtrain_home(), "autotune", safe_part(self.dag_id), safe_part(run_id),
                            safe_part(self.task_id))

    def build_spec(self, context):
        from dtrain.autotune.runner import AutotuneSpec
        from dtrain.autotune.shape import device_and_hosts

        placement = self.resolve_placement()
        device, hosts = device_and_hosts(placement)
        return AutotuneSpec(command=self.command, deepspeed_config=self.deepspeed_config, autotuning=self.autotuning,
                            nodes=placement.nodes, procs_per_node=placement.procs_per_node, hosts=hosts, device=device,
                            work_dir=self.work_dir or self._work_dir(context), env=self.env)

    def execute(self, context) -> dict[str, Any]:
        from dtrain.autotune.runner import run_autotune

        spec = self.build_spec(context)

        def started(proc) -> None:
            self._proc = proc

        result = run_autotune(spec, sink=self.log.info, started=started)
        self.log.info("autotuning summary (%s):\n%s", result["results_dir"], result["summary_text"])
        self.log.info("optimal config (%s, %s %s): %s", result["best_experiment"], "throughput",
                      result["best_metric_value"], result["optimal_config"])
        return result

    def on_kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self.log.info("on_kill: stopping DeepSpeed's autotuner and its experiments")
            os.killpg(self._proc.pid, signal.SIGTERM)
