"""What every backend needs to know about one job besides its spec: ids, directories, rank env."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.core.torchrun import AGENT_ENV
from dtrain.launch.node.net import free_port  # noqa: F401 (re-exported: where callers look for it)
from dtrain.paths import job_run_dir
from dtrain.rundir import CHECKPOINTS, DEEPSPEED_CONFIG, EXITS, METRICS, RunDir, UnsafeRunDir


#: XCom key under which the training operator records where its job writes (the Training tab reads it)
RUN_RECORD_KEY = "dtrain_run"
#: XCom key of an elastic job's rounds when it failed (a job that succeeded has them in its result)
ROUNDS_KEY = "dtrain_rounds"


@dataclass
class Job:
    spec: LaunchSpec
    job_id: str
    run_dir: str
    rank_env: dict[str, str] = field(default_factory=dict)

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.run_dir, CHECKPOINTS)

    @property
    def metrics_dir(self) -> str:
        return os.path.join(self.run_dir, METRICS)

    @property
    def exits_dir(self) -> str:
        return os.path.join(self.run_dir, EXITS)


def run_record(spec: LaunchSpec) -> dict:
    """What the operator records (XCom :data:`RUN_RECORD_KEY`) before it launches: the run directory
    every file of the job lies under, and the job's shape. Primitives only."""
    return {
        "run_dir": os.path.abspath(spec.run_dir or ""), "backend": spec.placement.backend,
        "nodes": spec.placement.nodes, "min_nodes": spec.placement.min_nodes,
        "procs_per_node": spec.placement.procs_per_node, "world_size": spec.world_size,
        "distribution": spec.distribution, "hang_timeout": spec.hang_timeout,
    }


def prepare_job(spec: LaunchSpec, *, create: bool = True) -> Job:
    """Create the run directory and the env every rank gets on top of the contract.

    The run directory survives the job: a relaunch with the same ``run_dir`` resumes
    from its checkpoints (the training helper looks there). ``create=False`` (a dry run)
    computes the same job and writes nothing.
    """
    # 12 random hex digits; not uuid, whose import (platform) costs every launch start-up time
    job_id = spec.job_id or f"dtrain-{os.urandom(6).hex()}"
    run_dir = os.path.abspath(spec.run_dir or job_run_dir(job_id))
    job = Job(spec=spec, job_id=job_id, run_dir=run_dir)
    run = RunDir(run_dir)
    if create:
        run.ensure_dir()
        for directory in (CHECKPOINTS, METRICS):
            try:
                run.ensure_dir(directory, owned=False)
            except UnsafeRunDir:
                pass  # the ranks' own directory, made a link by them: the product never reads through it
        # Exit records of an earlier attempt would be mistaken for this attempt's failures; a link
        # planted as exits/ is removed, never followed (RunDir.clear).
        run.clear(EXITS)
    env = {
        **AGENT_ENV,  # read by the torchrun agents (restarts that work); harmless to the ranks
        "DTRAIN_JOB_ID": job_id,
        "DTRAIN_RUN_DIR": run_dir,
        "DTRAIN_CHECKPOINT_DIR": job.checkpoint_dir,
        "DTRAIN_METRICS_DIR": job.metrics_dir,
        "DTRAIN_DISTRIBUTION": spec.distribution,
        "DTRAIN_DEVICE": "gpu" if spec.uses_gpu() else "cpu",
        "PYTHONUNBUFFERED": "1",
    }
    if spec.pass_local_rank:
        env["DTRAIN_PASS_LOCAL_RANK"] = "1"  # the rank wrapper appends --local_rank=N
    if spec.resolved_deepspeed_config is not None:
        path = run.join(DEEPSPEED_CONFIG)
        if create:
            run.write_json(DEEPSPEED_CONFIG, value=spec.resolved_deepspeed_config, indent=2)
        env["DTRAIN_DEEPSPEED_CONFIG"] = path
        if not spec.uses_gpu():
            env["DS_ACCELERATOR"] = "cpu"
    env.update(spec.env)
    env.update(spec.secret_env)  # every backend's channel for rank_env keeps it out of argv and files
    job.rank_env = env
    return job
