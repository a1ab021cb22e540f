"""DistributedTrainingOperator: a thin Airflow operator over the launch engine.

Declarative at parse time: ``__init__`` stores arguments and does no I/O and no
validation of templated values; ``execute`` renders, converts and validates them
(so Params typed in the UI work), launches, streams every rank's output into the
task log, and returns the result through XCom. ``on_kill`` tears down every rank.

Three ways to wait for the job (docs/airflow-faults.md):

* deferrable: submit, then wait in the triggerer (:mod:`dtrain.launch.airflow.deferrable`);
* durable (default where the backend's jobs outlive the worker: ssh, slurm): submit detached,
  record the handle in Airflow's task state store (``ResumableJobMixin``) and poll from the
  worker; a retry after a worker crash re-attaches to the job instead of starting a second one
  (:mod:`dtrain.launch.airflow.resumable`);
* blocking (local, mpirun, or ``durable=False``): the job lives and dies with the worker.

Failures are classified for Airflow's retry policy (:mod:`dtrain.launch.engine.retry`): bad input
fails without retrying, preemption / a lost node / a communication error / a hang retries.
"""

from __future__ import annotations

from typing import Any, Sequence

from airflow.configuration import conf
from airflow.sdk import BaseOperator, ResumableJobMixin

from dtrain.errors import SpecError
from dtrain.launch.airflow.links import LINKS
from dtrain.launch.airflow.placement_args import PLACEMENT_TABLE, PlacementArgs
from dtrain.launch.airflow.retry_policy import TrainingRetryPolicy
from dtrain.launch.core.spec_options import JOB_OPTIONS, OPERATOR_HANG_TIMEOUT
from dtrain.paths import task_run_dir

_DEFAULT_POLICY: Any = object()  # tells "no retry_policy given" from an explicit None
DEFAULT_HANG_TIMEOUT = OPERATOR_HANG_TIMEOUT
#: the job's options this operator takes as keyword parameters (its placement's through PlacementArgs)
JOB_PARAMETERS = JOB_OPTIONS.subset([o.name for o in JOB_OPTIONS if o.operator and o.name not in PLACEMENT_TABLE])


class DistributedTrainingOperator(PlacementArgs, ResumableJobMixin, BaseOperator):
    """Run a training command on ``nodes`` x ``procs_per_node`` ranks with the env contract.

    The job's keyword parameters, their defaults and which are templated come from
    :data:`~dtrain.launch.core.spec_options.JOB_OPTIONS` (the table in docs/backends.md); the signature
    Airflow and ``help()`` read lists them all.

    Args:
        command: argv run on every rank (templated; no shell).
        nodes: number of nodes (templated; strings from Params are converted), or "MIN:MAX" for an elastic
            job (local, ssh, slurm; docs/elastic.md).
        procs_per_node: processes per node (templated).
        distribution: ``pytorch`` | ``deepspeed`` | ``mpi`` | ``tensorflow`` (templated).
        backend: a registered backend (``local`` | ``ssh`` | ``slurm`` | ``mpi`` | an installed one; templated).
        backend_options: ``{backend name: that backend's options}`` (templated); the chosen backend's
            section is used, e.g. ``{"ssh": {"conn_id": "gpu_hosts"}, "slurm": {"partition": "gpu"}}``.
            ``ssh``: ``hostfile`` or ``hosts`` (DeepSpeed ``host slots=N`` lines, optionally
            ``user@host:port``), ``conn_id`` (an Airflow SSH connection giving them) and the connection
            settings (``user``, ``port``, ``key_file``, ``fanout``...: the ssh table of docs/backends.md).
            ``slurm``: the fields of :class:`dtrain.launch.backends.slurm.SlurmOptions`.
        env: extra environment for every rank (templated).
        deepspeed_config: DeepSpeed JSON config path or dict (templated), validated before launch.
        max_restarts: torchrun worker restarts after a failure.
        run_dir: checkpoints/metrics directory (templated). Default
            ``$DTRAIN_HOME/runs/<dag_id>/<run_id>/<task_id>``, so an Airflow retry of the same
            run resumes from its checkpoint and other runs never share it.
        device, gpus_per_node, rdzv_timeout, workdir: as in :class:`dtrain.launch.core.spec.LaunchSpec`.
        hang_timeout: seconds a rank may show no progress (a printed line, a metrics record, a
            ``heartbeat()``) before the job is declared hung: every rank's stack is dumped, the job
            stopped, and the task fails naming the stuck rank(s), with the verdict in XCom (key
            ``hang``); default 1800; None turns it off (templated; docs/hangs.md).
        stop_grace: seconds a rank has after SIGTERM (a stop, a preemption) to save a checkpoint
            before it is killed (default 30; docs/preemption.md).
        model_parallel_size, pipeline_parallel_size: distribution ``deepspeed``: the tensor and
            pipeline parallel sizes the script uses; DeepSpeed's batch arithmetic counts the
            data-parallel ranks (world size / both). Templated (docs/deepspeed.md).
        pass_local_rank: append ``--local_rank=N`` to every rank's command, as the ``deepspeed``
            launcher does. ``command`` may also use per-rank placeholders such as
            ``{deepspeed_config}`` and ``{local_rank}`` (dtrain.launch.node.placeholders).
        mpi_options: distribution ``mpi``: extra mpirun options (allow-listed).
        parameter_servers: distribution ``tensorflow``: how many ranks are ``ps`` tasks.
        deferrable: submit the job, then wait in the triggerer instead of a worker slot (backends
            whose jobs outlive the worker: ssh, slurm; see dtrain.launch.airflow.deferrable). Default:
            Airflow's ``[operators] default_deferrable``, as the providers do.
        durable: (``ResumableJobMixin``, default True) on backends whose jobs outlive the worker,
            submit detached and record the job in the task state store, so that a retry after a
            worker crash re-attaches to it (or takes its result if it already succeeded) instead of
            running it twice. False: the job is tied to the worker process, as with ``local``. An
            elastic job (``nodes="MIN:MAX"``) always runs attached: its rendezvous store lives with the task.
        retry_policy: Airflow's retry policy; default :class:`TrainingRetryPolicy` (bad input fails
            at once, transient faults retry; ``retries`` still bounds the tries). None: no policy.
        aws_conn_id: an Airflow AWS connection whose credentials every rank gets as the standard
            AWS variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
            ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``), e.g. for ``CheckpointManager(directory="s3://...")``.
            Read on the worker when the task runs (not templated: params cannot choose it), and
            carried as the rest of the job's environment is on backends that keep it out of every
            argv, log line, XCom and file: ``local`` and ``mpi`` (the processes' environment), ``ssh``
            (the ssh session's stdin). ``slurm`` refuses it (its sbatch script would hold it). None
            (default): the ranks use their own environment.
    """

    template_fields: Sequence[str] = ("command", *JOB_OPTIONS.templated)
    template_fields_renderers = {"env": "json", "deepspeed_config": "json", "command": "py", "backend_options": "json"}
    ui_color = "#d7e9f7"
    operator_extra_links = tuple(LINKS)  # checkpoints, metrics, TensorBoard (dtrain.launch.airflow.links)
    # Task state store key holding the submitted job's handle. Renaming it breaks the re-attach of
    # retries already in flight (their value is stored under the old key).
    external_id_key = "dtrain_job"

    @JOB_OPTIONS.keywords  # one keyword parameter per job option: Airflow's default_args reach them
    def __init__(
        self,
        *,
        command: Sequence[str] | str,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        retry_policy: Any = _DEFAULT_POLICY,
        aws_conn_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        if retry_policy is _DEFAULT_POLICY:
            retry_policy = TrainingRetryPolicy()
        job = JOB_PARAMETERS.operator_values(kwargs)
        placement = PLACEMENT_TABLE.operator_values(kwargs)
        super().__init__(retry_policy=retry_policy, **kwargs)  # refuses an unknown keyword
        self.command = command
        self.init_placement(**placement)
        for name, value in job.items():
            setattr(self, name, value)
        self.env = self.env or {}
        self.deferrable = deferrable
        self.aws_conn_id = aws_conn_id
        self._launcher = None
        self._result: dict[str, Any] | None = None  # durable mode: the followed job's XCom result
        self.last_result: dict[str, Any] | None = None  # read by the extra links after success

    def default_run_dir(self, context) -> str:
        run_id = context["run_id"] if "run_id" in context else "manual"
        return task_run_dir(self.dag_id, run_id, self.task_id)

    def build_spec(self, context):
        from dtrain.launch.core.spec import LaunchSpec

        values = {name: getattr(self, name) for name in JOB_PARAMETERS.names}
        # Rendered templates and UI Params: an empty string or "None" is no value.
        values.update(deepspeed_config=self.deepspeed_config or None, mpi_options=self.mpi_options or None,
                      run_dir=self.run_dir or self.default_run_dir(context),
                      hang_timeout=None if self.hang_timeout in (None, "", "None") else self.hang_timeout)
        return LaunchSpec(command=self.command, placement=self.resolve_placement(), secret_env=self._connection_env(),
                          **values)

    def _connection_env(self) -> dict[str, str]:
        """The AWS connection's credentials for the ranks, read here on the worker at execute time."""
        if not self.aws_conn_id:
            return {}
        from dtrain.hooks.aws import aws_environment

        return aws_environment(self.aws_conn_id, self.log)

    def execute(self, context) -> dict[str, Any]:
        from dtrain.launch.engine.launcher import Launcher

        spec = self.build_spec(context)  # raises SpecError before anything starts
        if spec.elastic and self.deferrable:
            raise SpecError("deferrable", True, "False for an elastic job (nodes=MIN:MAX): its rendezvous store "
                                                "lives with the task that launches it (docs/elastic.md)")
        self._record_run(spec, context)
        if self.deferrable:
            from dtrain.launch.airflow.deferrable import defer_job

            return defer_job(self, spec, context)
        self._launcher = Launcher(spec, sink=self.log.info)
        if spec.elastic and self.durable:
            self.log.info("an elastic job runs attached to this task (not durable): its rendezvous store lives "
                          "with the task (docs/elastic.md)")
        if self.durable and self._launcher.backend.supports_detached and not spec.elastic:
            self._result = None
            # The mixin returns poll_until_complete's value only when it reconnects; the result is
            # kept on the operator instead, whichever way the job was reached (as Athena's does).
            self.execute_resumable(context)
            self.last_result = self._result
            return self.last_result
        result = self._launcher.run()
        self._raise_for_status(result, context)
        self.log.info("world_size=%s duration=%.1fs checkpoints=%s metrics=%s",
                      result.world_size, result.duration_s, result.checkpoint_dir, result.metrics)
        self.last_result = result.to_xcom()
        return self.last_result

    def _record_run(self, spec, context) -> None:
        """Where the job writes, in XCom before it starts: the Training tab (dtrain.ui) reads the
        run directory from this record, never from a request, while the job runs and after it failed.

        An XCom can be PATCHed by anyone who may edit the task instance, so the directory is marked
        first (dtrain.rundir.write_marker; the UI's check: dtrain.ui.provenance): the UI shows it only while the marker names this task instance."""
        from dtrain.launch.core.job import RUN_RECORD_KEY, run_record
        from dtrain.rundir import write_marker

        ti = (context or {}).get("ti")
        if ti is not None:
            record = run_record(spec)
            write_marker(record["run_dir"], ti)
            ti.xcom_push(key=RUN_RECORD_KEY, value=record)

    def on_kill(self) -> None:
        why = self._job_kept()
        if why:  # durable mode: another try follows the job, or will
            self.log.warning("on_kill: leaving job %s running: %s", getattr(self._launcher.job, "job_id", "?"), why)
            self._launcher.leave(why)
            return
        if self._launcher is not None:
            self.log.info("on_kill: stopping every rank of job %s", getattr(self._launcher.job, "job_id", "?"))
            self._launcher.terminate()
        from dtrain.launch.airflow.deferrable import kill_job

        kill_job(self)  # a job submitted detached (deferrable or durable mode): cancel it on every host

    def _job_kept(self) -> str:
        """Why on_kill must leave the durable job this try follows running ('' to stop it: not durable, or
        nothing follows it any more): :func:`dtrain.launch.airflow.resumable.kept_for`."""
        from dtrain.launch.airflow.deferrable import FOLLOWER_KEY, SUBMISSION_KEY
        from dtrain.launch.airflow.resumable import kept_for
        from dtrain.launch.backends import JobHandle

        ti, record = getattr(self, FOLLOWER_KEY, None), getattr(self, SUBMISSION_KEY, None)
        if ti is None or not record or self._launcher is None or not self._launcher.following:
            return ""  # not durable, or its watch ended already (an execution timeout: it stopped the job)
        return kept_for(JobHandle.from_dict(record), int(ti.try_number), lambda: _state_now(ti))

    # -- ResumableJobMixin (durable mode): how this operator submits, finds and follows its job ------

    def submit_job(self, context) -> dict[str, Any]:
        """Submit detached, record the handle in the run directory; the mixin stores what this returns."""
        from dtrain.launch.airflow.resumable import with_secret, write_submission

        handle = with_secret(self._launcher.submit_detached())
        write_submission(handle)
        self._track(handle, context)
        return handle.to_dict()

    def get_job_status(self, external_id, context) -> str:
        from dtrain.launch.airflow.resumable import recorded_status

        return recorded_status(self._launcher.backend, external_id, self._launcher.spec.run_dir, self.log.warning)

    def is_job_active(self, status: str) -> bool:
        from dtrain.launch.airflow.resumable import is_active

        return is_active(status)

    def is_job_succeeded(self, status: str) -> bool:
        from dtrain.launch.airflow.resumable import is_succeeded

        return is_succeeded(status)

    def poll_until_complete(self, external_id, context) -> dict[str, Any]:
        """Follow the job to its end (streaming its output); raise LaunchError if it failed."""
        from dtrain.launch.airflow.deferrable import FOLLOWER_KEY
        from dtrain.launch.airflow.resumable import recorded_handle

        launcher = self._launcher
        handle = recorded_handle(external_id, launcher.backend.name, launcher.spec.run_dir)
        self._track(handle, context)
        follower = getattr(self, FOLLOWER_KEY, None)
        result = launcher.attach(handle, None if follower is None else int(follower.try_number))
        self._raise_for_status(result, context)
        self.log.info("world_size=%s duration=%.1fs checkpoints=%s metrics=%s",
                      result.world_size, result.duration_s, result.checkpoint_dir, result.metrics)
        self._result = result.to_xcom() | {f"{handle.backend}_job_id": handle.backend_job_id}
        return self._result

    def get_job_result(self, external_id, context) -> dict[str, Any]:
        # Not followed yet: the job of an earlier try succeeded while no worker watched it. Reading
        # its outcome is one poll (it is over) plus its output and records.
        return self._result if self._result is not None else self.poll_until_complete(external_id, context)

    def _raise_for_status(self, result, context) -> None:
        """Fail the task if the job failed; a hang's verdict (stuck ranks, stack dump paths) and an
        elastic job's rounds go to XCom first, where a downstream task, a person or the Training tab
        can read them (a job that succeeded has its rounds in its result)."""
        from dtrain.launch.core.job import ROUNDS_KEY

        ti = (context or {}).get("ti")
        if result.hang and ti is not None:
            ti.xcom_push(key="hang", value=result.hang)
        if result.rounds and not result.ok and ti is not None:
            ti.xcom_push(key=ROUNDS_KEY, value=result.rounds)
        result.raise_for_status()

    def _track(self, handle, context) -> None:
        """on_kill cancels this job from now on, unless a later try follows it (this try records that it
        follows it now: the follower record); the backend's job id goes to XCom at once."""
        from dtrain.launch.airflow.deferrable import FOLLOWER_KEY, SUBMISSION_KEY
        from dtrain.launch.engine.submission import write_follower

        setattr(self, SUBMISSION_KEY, handle.to_dict())
        ti = (context or {}).get("ti")
        if ti is not None:
            setattr(self, FOLLOWER_KEY, ti)
            write_follower(handle, int(ti.try_number))
            ti.xcom_push(key=f"{handle.backend}_job_id", value=handle.backend_job_id)

    def execute_complete(self, context, event: dict[str, Any] | None = None) -> dict[str, Any]:
        """Resumed by the trigger's event (deferrable mode): raise with the log tail on failure."""
        from dtrain.launch.airflow.deferrable import resume_job

        ti = (context or {}).get("ti")
        if isinstance(event, dict) and event.get("status") == "hung" and ti is not None:
            ti.xcom_push(key="hang", value=event.get("hang"))
        self.last_result = resume_job(self, event)
        return self.last_result


def _state_now(ti) -> str | None:
    """The task instance's state now (its latest try's), through Airflow's execution API; None when it cannot
    be asked (the API server unreachable: a cut-off worker)."""
    try:
        runs = ti.get_task_states(dag_id=ti.dag_id, map_index=ti.map_index, task_ids=[ti.task_id], run_ids=[ti.run_id])
    except Exception:  # noqa: BLE001 - a stop must go on whatever the question met
        return None
    tasks = (runs or {}).get(ti.run_id) or {}
    state = tasks.get(ti.task_id if ti.map_index is None or ti.map_index < 0 else f"{ti.task_id}_{ti.map_index}")
    return None if state is None else str(getattr(state, "value", state))
