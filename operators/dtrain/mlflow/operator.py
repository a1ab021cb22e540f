"""The retraining pipeline's train task when its registry tracks runs (MLflow): one run per train task.

Before launch, once the spec is validated (bad input creates nothing): the task finds the run of
this DAG run (a retry) or creates it (dtrain.mlflow.tracking), tags it with the DAG id, run id, try,
partition and dataset version, logs the job's shape and the pipeline's params, and gives the
ranks ``MLFLOW_RUN_ID``, ``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_ID``. After the job it
logs, from what the job wrote, rank 0's per-step curves, the data-stall verdicts and the run
directory's locations, and ends the run FINISHED (FAILED when the try failed; the next try sets it
RUNNING again). Training scripts need no MLflow code.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from dtrain.launch.airflow.operator import DistributedTrainingOperator
from dtrain.pipeline.config import partition_of
from dtrain.pipeline.registry import ModelRegistry
from dtrain.mlflow.tracking import RUN_XCOM_KEY

#: the job's shape, as logged params
SHAPE = ("nodes", "procs_per_node", "world_size", "distribution", "backend")
#: what a training script's result (metrics/result.json) may carry that is a param of the run
RESULT_PARAMS = {"global_batch": "global_batch", "global_batch_size": "global_batch", "lr": "scaled_lr",
                 "scaled_lr": "scaled_lr"}


class TrackedTrainingOperator(DistributedTrainingOperator):
    """:class:`DistributedTrainingOperator` whose job is an experiment run of ``registry``."""

    def __init__(self, *, registry: ModelRegistry, run_params: Callable[[Mapping[str, Any]], Mapping[str, Any]],
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.registry = registry
        self.run_params = run_params  # the run's params as its tasks use them (the factory's dtrain_params)
        self._tracked: tuple[Any, Any] | None = None  # (server, run) while this try runs

    def _run_tags(self, context, spec) -> dict[str, str]:
        dag_run = context["dag_run"]
        return {"dtrain.dag_id": self.dag_id, "dtrain.run_id": dag_run.run_id,
                "dtrain.task_try": str(context["ti"].try_number), "dtrain.partition": partition_of(dag_run),
                "dtrain.dataset_version": str(context["params"]["dataset_version"]),
                "dtrain.run_dir": spec.run_dir, "dtrain.checkpoint_dir": f"{spec.run_dir}/checkpoints"}

    def _record_run(self, spec, context) -> None:
        """Start (or resume) the run before the job starts, and hand its id to the ranks."""
        super()._record_run(spec, context)
        from dtrain.launch.core.job import run_record
        from dtrain.mlflow.tracking import log_params, run_env, run_key, start_or_resume

        server = self.registry.server()
        key = run_key(self.dag_id, context["dag_run"].run_id, context["dag_run"].clear_number or 0)
        with server.signed_in():
            client = server.client()
            run, resumed = start_or_resume(client, self.registry.experiment_name, key, self._run_tags(context, spec))
            shape = run_record(spec)
            params = {name: shape[name] for name in SHAPE}
            params.update(self.run_params(context["params"]))
            log_params(client, run, params)
        self._tracked = (server, run)
        spec.env = {**spec.env, **run_env(server, run)}
        context["ti"].xcom_push(key=RUN_XCOM_KEY, value={"run_id": run.info.run_id,
                                                          "experiment_id": run.info.experiment_id})
        self.log.info("MLflow run %s %s: %s", run.info.run_id, "resumed" if resumed else "created",
                      server.run_url(run.info.experiment_id, run.info.run_id))

    def _end(self, result: dict[str, Any] | None) -> None:
        """Log what the job wrote and end the run: FINISHED with a result, FAILED without one."""
        if self._tracked is None:
            return
        server, run = self._tracked
        self._tracked = None
        with server.signed_in():
            client = server.client()
            if result is not None:
                self._log_job(client, run.info.run_id, result)
            client.set_terminated(run.info.run_id, "FINISHED" if result is not None else "FAILED")

    @staticmethod
    def _log_job(client, run_id: str, result: dict[str, Any]) -> None:
        from dtrain.rundir import RunDir, UnsafeRunDir
        from dtrain.mlflow.tracking import log_metrics, log_params, scalar_series, stall_series, step_series

        try:  # rank-written records: read through RunDir (no link followed, every file bounded)
            records = RunDir(result["run_dir"]).metrics()
        except UnsafeRunDir:
            records = {}
        series = step_series(records)
        last = max((step for pairs in series.values() for step, _ in pairs), default=0)
        series.update(stall_series(result.get("stall"), last))
        outcome = result.get("metrics") or {}
        series.update(scalar_series("train.", outcome, last))
        log_metrics(client, run_id, series, int(time.time() * 1000))
        run = client.get_run(run_id)
        log_params(client, run, {param: outcome[name] for name, param in RESULT_PARAMS.items()
                                 if name in outcome and not isinstance(outcome[name], (dict, list))})

    def execute(self, context) -> dict[str, Any]:
        from airflow.sdk.exceptions import TaskDeferred

        try:
            result = super().execute(context)
        except TaskDeferred:
            raise  # the run stays RUNNING while the triggerer waits; execute_complete ends it
        except BaseException:
            self._end(None)
            raise
        self._end(result)
        return result

    def execute_complete(self, context, event: dict[str, Any] | None = None) -> dict[str, Any]:
        from dtrain.mlflow.tracking import find_run, run_key

        server = self.registry.server()  # a resumed task is a new process: find the run again
        key = run_key(self.dag_id, context["dag_run"].run_id, context["dag_run"].clear_number or 0)
        with server.signed_in():
            client = server.client()
            experiment = client.get_experiment_by_name(self.registry.experiment_name)
            run = find_run(client, experiment.experiment_id, key) if experiment is not None else None
        self._tracked = (server, run) if run is not None else None
        try:
            result = super().execute_complete(context, event)
        except BaseException:
            self._end(None)
            raise
        self._end(result)
        return result
