"""The Slurm backend: one sbatch job; ``srun`` starts one torchrun agent per node.

It submits with ``sbatch --parsable``, polls ``scontrol show job`` (``sacct`` only as a
fallback: without accounting storage it has no data), streams the job's output file,
returns the failing exit code and cancels with ``scancel``. A Slurm job outlives the
submitting process by nature, so every submission can be deferred or re-attached: the
handle holds the Slurm job id and the run directory, where the batch script records
srun's exit status. The pure part (options, script, parsing) is :mod:`.render`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time


from dtrain.errors import DTrainError, LaunchError
from dtrain.launch.backends.base import Backend, DryRunRequest, JobHandle, JobStatus, run_async
from dtrain.launch.backends.slurm import render as R
from dtrain.launch.backends.slurm.render import SlurmOptions
from dtrain.launch.job import Job
from dtrain.launch.spec import LaunchSpec
from dtrain.launch.tailfile import TAIL_LINES, LogFollower, read_tail


def _run(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        raise DTrainError(f"{argv[0]} not found: the slurm backend needs the Slurm client commands on PATH") from e
    except subprocess.TimeoutExpired as e:
        raise DTrainError(f"{' '.join(argv[:3])} did not answer within {timeout:.0f}s") from e


def sbatch(script_path: str, cwd: str | None = None) -> str:
    """``sbatch --parsable SCRIPT`` -> the Slurm job id."""
    proc = subprocess.run(R.sbatch_argv(script_path), capture_output=True, text=True, timeout=120, cwd=cwd,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise LaunchError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}", proc.returncode)
    return R.parse_job_id(proc.stdout)


def query(job_id: str, run_dir: str) -> JobStatus:
    """The job's status now: scontrol first; sacct if scontrol forgot it; the script's record."""
    proc = _run(R.show_job_argv(job_id))
    fields = R.fields_or_raise(job_id, proc.returncode, proc.stdout, proc.stderr)
    if not fields.get("JobState"):
        try:
            acct = _run(R.sacct_argv(job_id))
            fields = R.parse_sacct(acct.stdout) if acct.returncode == 0 else {}
        except DTrainError:
            fields = {}
    return R.decide(job_id, fields, R.read_exit_record(run_dir, job_id))


async def async_query(job_id: str, run_dir: str) -> JobStatus:
    """Async twin of :func:`query` (same argv, same decision), for the triggerer."""
    try:
        rc, out, err = await run_async(R.show_job_argv(job_id))
    except TimeoutError as e:
        raise DTrainError(f"scontrol show job {job_id} timed out") from e
    fields = R.fields_or_raise(job_id, rc, out, err)
    if not fields.get("JobState") and shutil.which("sacct"):
        try:
            rc, out, _ = await run_async(R.sacct_argv(job_id))
            fields = R.parse_sacct(out) if rc == 0 else {}
        except (TimeoutError, DTrainError):
            fields = {}
    return R.decide(job_id, fields, R.read_exit_record(run_dir, job_id))


def scancel(job_id: str) -> None:
    proc = _run(R.cancel_argv(job_id))
    if proc.returncode != 0 and "already completed" not in proc.stderr and "Invalid job id" not in proc.stderr:
        raise DTrainError(f"scancel {job_id} failed: {proc.stderr.strip()}")


def wait_until_done(job_id: str, run_dir: str, timeout: float = 60.0, interval: float = 0.25) -> JobStatus:
    """Poll until the job is in a terminal state (COMPLETING counts as still running:
    its processes are being killed)."""
    deadline = time.monotonic() + timeout
    status = query(job_id, run_dir)
    while not status.done and time.monotonic() < deadline:
        time.sleep(interval)
        status = query(job_id, run_dir)
    return status


class SlurmBackend(Backend):
    """Submit the job with sbatch and follow it until it ends; ``cancel`` scancels it."""

    name = "slurm"
    description = "one sbatch job; srun starts one torchrun agent per node"
    install_hint = "apt-get install slurm-client (sbatch, squeue, scontrol, scancel)"
    option_names = tuple(SlurmOptions.__dataclass_fields__)
    supports_detached = True
    cli_module = "dtrain.launch.backends.slurm.cli"

    def __init__(self, sink=None, cancel_timeout: float = 60.0):
        super().__init__(**({"sink": sink} if sink else {}))
        self.cancel_timeout = cancel_timeout
        self._followers: dict[str, LogFollower] = {}

    @classmethod
    def validate(cls, spec: LaunchSpec) -> None:
        options = R.coerce_options(spec.backend_options)  # SpecError naming an unknown or bad option
        if spec.run_dir is not None:
            R.check_run_dir(os.path.abspath(str(spec.run_dir)))
        spec.resolved = options
        spec.backend_options = {k: v for k, v in vars(options).items() if v not in (None, (), [])}
        spec.backend_options["extra_sbatch"] = list(options.extra_sbatch)

    @staticmethod
    def _options(spec: LaunchSpec) -> SlurmOptions:
        return spec.resolved if isinstance(spec.resolved, SlurmOptions) else R.coerce_options(spec.backend_options)

    def dryrun(self, job: Job, *, detached: bool = False) -> DryRunRequest:
        script = R.render_sbatch(job, self._options(job.spec))
        return DryRunRequest(backend=self.name, argvs=(tuple(R.sbatch_argv(R.script_path(job))),), script=script)

    def submit(self, job: Job, *, detached: bool = False) -> JobHandle:
        options = self._options(job.spec)
        script = R.write_script(job, options)
        job_id = sbatch(script, cwd=job.spec.workdir)
        self.poll_interval = options.poll_interval
        self.sink(f"[dtrain] submitted slurm job {job_id} ({job.spec.nodes} node(s)); "
                  f"output: {R.log_path(job.run_dir, job_id)}")
        return JobHandle(backend=self.name, job_id=job.job_id, backend_job_id=job_id, run_dir=job.run_dir,
                         world_size=job.spec.world_size, submitted_at=time.time(),
                         data={"poll_interval": options.poll_interval})

    def _with_tail(self, handle: JobHandle, status: JobStatus) -> JobStatus:
        """A finished job's status carries the end of its output file (why it failed, or its summary)."""
        if status.done:
            from dataclasses import replace

            return replace(status, tail=read_tail(R.log_path(handle.run_dir, handle.backend_job_id), TAIL_LINES))
        return status

    def poll(self, handle: JobHandle) -> JobStatus:
        return self._with_tail(handle, query(handle.backend_job_id, handle.run_dir))

    async def async_poll(self, handle: JobHandle) -> JobStatus:
        return self._with_tail(handle, await async_query(handle.backend_job_id, handle.run_dir))

    def follow(self, handle: JobHandle) -> None:
        follower = self._followers.setdefault(handle.backend_job_id,
                                              LogFollower(R.log_path(handle.run_dir, handle.backend_job_id), self.sink))
        follower.poll()

    def release(self, handle: JobHandle) -> None:
        follower = self._followers.pop(handle.backend_job_id, None)
        if follower is not None:
            follower.poll(final=True)

    def cancel(self, handle: JobHandle) -> None:
        """scancel the job and wait until Slurm reports it ended."""
        scancel(handle.backend_job_id)
        wait_until_done(handle.backend_job_id, handle.run_dir, timeout=self.cancel_timeout)

    async def async_cancel(self, handle: JobHandle) -> None:
        rc, _, err = await run_async(R.cancel_argv(handle.backend_job_id))
        if rc != 0:
            self.sink(f"[dtrain] scancel {handle.backend_job_id}: {err.strip()}")

    def logs(self, handle: JobHandle, lines: int = 40) -> list[str]:
        return read_tail(R.log_path(handle.run_dir, handle.backend_job_id), lines)

    def run(self, job: Job):
        outcome = super().run(job)
        if outcome.exit_code > 0:
            self.sink(f"[dtrain] slurm job ended with exit code {outcome.exit_code}")
        elif outcome.exit_code == 0:
            outcome.tail = []  # success: no failure tail to report
        return outcome


__all__ = ["SlurmBackend", "SlurmOptions", "query", "wait_until_done", "sbatch", "scancel"]
