"""Slurm, the pure part: options, the sbatch script, and the reading of Slurm's answers.

Split torchx-style into this pure module and :mod:`.backend`, which talks to Slurm:

* :class:`SlurmOptions` (validated: partition, time limit, account, ...) and
  :func:`render_sbatch` turn a prepared :class:`~dtrain.launch.job.Job` into the exact
  sbatch script (tested by string comparison; ``dtrain launch --dry-run`` prints it);
  :func:`parse_scontrol_job` and :func:`decide` turn Slurm's answers into a status.

In the script every value that reaches the shell is ``shlex.quote``'d; the values on
``#SBATCH`` lines, which sbatch parses itself, are restricted to a safe alphabet by
:class:`SlurmOptions` and the run-directory check. The batch script records srun's exit
status in the run directory, so the result survives the job leaving Slurm's memory
(``MinJobAge``) and a cluster without accounting.

Stdlib only and no Airflow: the async trigger and the CLI import it cheaply.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from dtrain.args import coerce_int, mapping_arg
from dtrain.errors import DTrainError, LaunchError, SpecError
from dtrain.launch.backends.base import JobStatus
from dtrain.launch.job import Job
from dtrain.launch.torchrun import Static, agent_argv

SCRIPT_NAME = "slurm-job.sh"
# Job states after which nothing of the job runs any more (scontrol/squeue/sacct spelling).
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT",
})
# Exit codes for states whose batch script reported nothing (killed before it could).
STATE_EXIT_CODES = {"CANCELLED": 143, "TIMEOUT": 124, "PREEMPTED": 143, "OUT_OF_MEMORY": 137}
UNKNOWN_JOB_EXIT_CODE = 1
MAX_POLL_ERRORS = 5  # consecutive failed polls before the job is given up (and cancelled)

_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,128}$")
_PARTITION = re.compile(r"^[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64})*$")
# Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; or UNLIMITED/INFINITE.
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}|\d+-\d{1,2}:\d{1,2}|\d+-\d{1,2}:\d{1,2}:\d{1,2}"
                   r"|UNLIMITED|INFINITE)$")
# An extra sbatch option: --name or --name=value, value in a safe alphabet (no quotes, spaces, $).
_EXTRA = re.compile(r"^--[a-z][a-z-]*(=[A-Za-z0-9_.,:=@/+%-]+)?$")
# What may appear in the --output path on an #SBATCH line (sbatch does its own, partial quoting).
_PATH = re.compile(r"^/[A-Za-z0-9_./+@:=,-]*$")
# Options that the backend sets itself and that an extra option must not override.
_RESERVED = ("--nodes", "--ntasks", "--ntasks-per-node", "--output", "--error", "--job-name", "--parsable",
             "--wrap", "--export", "--chdir", "--partition", "--time", "--account", "--gpus-per-node")


@dataclass(frozen=True)
class SlurmOptions:
    """Where and how long the job may run. Validated here, before anything is submitted.

    Args:
        partition: ``-p`` (a name, or a comma-separated list); default the cluster's default.
        time_limit: ``--time`` in Slurm's formats (``90``, ``1:30:00``, ``2-00:00:00``...).
        account: ``--account`` to charge.
        gpus_per_node: GPUs requested per node (``--gpus-per-node``). Default: the spec's
            ``gpus_per_node`` when the job uses GPUs, otherwise none requested.
        job_name: ``--job-name``; default the job id.
        python: the interpreter on the compute nodes (with this package installed);
            default this interpreter (a shared virtualenv is the common set-up).
        extra_sbatch: further ``--option[=value]`` lines (``--qos=high``, ``--exclusive``).
        poll_interval: seconds between ``scontrol show job`` polls.
        master_port: rendezvous port on the first node; 0 derives it from the Slurm job id
            at run time (20000 + id % 20000), so concurrent jobs on a node differ.
    """

    partition: str | None = None
    time_limit: str | None = None
    account: str | None = None
    gpus_per_node: int | None = None
    job_name: str | None = None
    python: str | None = None
    extra_sbatch: Sequence[str] = field(default_factory=tuple)
    poll_interval: float = 2.0
    master_port: int = 0

    def __post_init__(self) -> None:
        def clean(name: str, value, pattern: re.Pattern, allowed: str):
            if value is None or (isinstance(value, str) and not value.strip()):
                return None
            text = str(value).strip()
            if not pattern.match(text):
                raise SpecError(name, value, allowed)
            return text

        set_ = object.__setattr__  # frozen: normalise in place once
        set_(self, "partition", clean("partition", self.partition, _PARTITION,
                                      "a Slurm partition name (letters, digits, _ . -), or a comma-separated list"))
        set_(self, "time_limit", clean("time_limit", self.time_limit, _TIME,
                                       "a Slurm time: minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S or UNLIMITED"))
        set_(self, "account", clean("account", self.account, _NAME, "an account name (letters, digits, _ . + -)"))
        set_(self, "job_name", clean("job_name", self.job_name, _NAME, "a job name (letters, digits, _ . + -)"))
        if self.gpus_per_node is not None:
            set_(self, "gpus_per_node", coerce_int("gpus_per_node", self.gpus_per_node, minimum=0, maximum=1024))
        extra = [self.extra_sbatch] if isinstance(self.extra_sbatch, str) else list(self.extra_sbatch or ())
        for item in extra:
            if not isinstance(item, str) or not _EXTRA.match(item):
                raise SpecError("extra_sbatch", item, "--option or --option=value (letters, digits, _ . , : = @ / + % -)")
            if item.split("=", 1)[0] in _RESERVED:
                raise SpecError("extra_sbatch", item, f"an option the backend does not set itself (not {', '.join(_RESERVED)})")
        set_(self, "extra_sbatch", tuple(extra))
        if self.python is not None and (not str(self.python).strip() or "\0" in str(self.python)):
            raise SpecError("python", self.python, "a path to the Python interpreter on the compute nodes")
        try:
            poll = float(self.poll_interval)
        except (TypeError, ValueError) as e:
            raise SpecError("poll_interval", self.poll_interval, "a number of seconds") from e
        if not 0.05 <= poll <= 3600:
            raise SpecError("poll_interval", self.poll_interval, "between 0.05 and 3600 seconds")
        set_(self, "poll_interval", poll)
        set_(self, "master_port", coerce_int("master_port", self.master_port, minimum=0, maximum=65535))


def coerce_options(options: "SlurmOptions | Mapping[str, Any] | str | None" = None) -> "SlurmOptions":
    """A :class:`SlurmOptions` from an operator argument: None, a dict (templated) or the object."""
    if options is None:
        return SlurmOptions()
    if isinstance(options, SlurmOptions):
        return options
    options = mapping_arg("slurm_options", options, not_json="a mapping (or a JSON object string)",
                          not_mapping="a mapping of SlurmOptions fields")
    allowed = set(SlurmOptions.__dataclass_fields__)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise SpecError("slurm_options", unknown, f"known keys: {', '.join(sorted(allowed))}")
    return SlurmOptions(**dict(options))


# ---------------------------------------------------------------------------------------------
# Pure rendering
# ---------------------------------------------------------------------------------------------

def log_path(run_dir: str, slurm_job_id: str) -> str:
    """Where the job's stdout and stderr go (``--output``): in the run directory, keyed by job id."""
    return os.path.join(run_dir, f"slurm-{slurm_job_id}.out")


def exit_path(run_dir: str, slurm_job_id: str) -> str:
    """Where the batch script records srun's exit status when it gets that far."""
    return os.path.join(run_dir, f"slurm-{slurm_job_id}.exit")


def requested_gpus(job: Job, options: SlurmOptions) -> int:
    if options.gpus_per_node is not None:
        return options.gpus_per_node
    spec = job.spec
    if spec.device == "cpu" or not spec.gpus_per_node:
        return 0
    return spec.gpus_per_node


def check_run_dir(run_dir: str) -> None:
    if not _PATH.match(run_dir):
        raise SpecError("run_dir", run_dir,
                        "for the slurm backend, an absolute path of letters, digits and _ . / + @ : = , - "
                        "(it appears on an #SBATCH --output line)")


def node_argv(job: Job, python: str) -> list[str]:
    """torchrun for one node, static rendezvous: Slurm fixes membership; the endpoint and node rank
    come at run time from PET_MASTER_ADDR/PORT and PET_NODE_RANK (= SLURM_NODEID) per node."""
    return agent_argv(job.spec, python=python, job_id=job.job_id, rdzv=Static())


# Runs inside every srun task: the per-node values exist only there. A constant: no user value in it.
NODE_SHELL = ('export NODE_RANK="$SLURM_NODEID" DTRAIN_NODE_INDEX="$SLURM_NODEID" PET_NODE_RANK="$SLURM_NODEID" '
              'PET_MASTER_ADDR="$MASTER_ADDR" PET_MASTER_PORT="$MASTER_PORT"; exec "$@"')

_ADDR_FUNCTION = """\
# A node's address: its NodeAddr in slurm.conf, else DNS; node names need not resolve.
dtrain_node_addr() {
  local addr
  addr=$(scontrol show node -o "$1" 2>/dev/null | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')
  if [ -z "$addr" ]; then addr=$(getent hosts "$1" | awk '{print $1; exit}'); fi
  printf '%s\\n' "${addr:-$1}"
}"""


def render_sbatch(job: Job, options: SlurmOptions, *, workdir: str | None = None) -> str:
    """The complete sbatch script for ``job``. Pure: the same inputs give the same text."""
    spec = job.spec
    check_run_dir(job.run_dir)
    python = options.python or sys.executable
    workdir = spec.workdir or workdir or os.getcwd()
    gpus = requested_gpus(job, options)
    directives = [
        f"--job-name={options.job_name or job.job_id}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={gpus}"] if gpus else []),
        *([f"--time={options.time_limit}"] if options.time_limit else []),
        *([f"--partition={options.partition}"] if options.partition else []),
        *([f"--account={options.account}"] if options.account else []),
        f"--output={log_path(job.run_dir, '%j')}",
        *options.extra_sbatch,
    ]
    q = shlex.quote
    exports = [f"export {name}={q(value)}" for name, value in sorted(job.rank_env.items())]
    port = str(options.master_port) if options.master_port else "$((20000 + SLURM_JOB_ID % 20000))"
    srun = ["srun", f"--nodes={spec.nodes}", f"--ntasks={spec.nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", "bash", "-c", NODE_SHELL, "dtrain-node"]
    command = " \\\n  ".join([" ".join(q(a) for a in srun), " ".join(q(a) for a in node_argv(job, python))])
    exit_file = q(job.run_dir) + '/slurm-"$SLURM_JOB_ID".exit'
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "# Rendered by airflow-dtrain: srun starts one torchrun agent per node.",
        "set -uo pipefail",
        f"cd {q(workdir)} || exit 1",
        *exports,
        _ADDR_FUNCTION,
        'MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'MASTER_ADDR=$(dtrain_node_addr "$MASTER_NODE")',
        f"MASTER_PORT={port}",
        "export MASTER_ADDR MASTER_PORT",
        'echo "[dtrain] slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: rendezvous $MASTER_NODE ($MASTER_ADDR:$MASTER_PORT)"',
        command,
        "status=$?",
        f'printf \'%s\\n\' "$status" > {exit_file}.tmp && mv -f {exit_file}.tmp {exit_file}',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def script_path(job: Job) -> str:
    return os.path.join(job.run_dir, SCRIPT_NAME)


def write_script(job: Job, options: SlurmOptions) -> str:
    """Render and write the script into the run directory (temp file + rename); returns its path.

    Owner-only permissions: the script carries the job's environment."""
    text = render_sbatch(job, options)
    path = script_path(job)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------
# Pure interpretation of Slurm's answers
# ---------------------------------------------------------------------------------------------

def parse_scontrol_job(text: str) -> dict[str, str]:
    """``scontrol show job -o ID`` output -> the fields we use (JobState, ExitCode, Reason, NodeList)."""
    fields = {}
    for key in ("JobId", "JobState", "ExitCode", "Reason", "NodeList"):
        m = re.search(rf"(?:^|\s){key}=(\S*)", text)
        if m:
            fields[key] = m.group(1)
    return fields


def parse_sacct(text: str) -> dict[str, str]:
    """``sacct -j ID -X -n -P -o JobID,State,ExitCode`` -> the same fields (first line)."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0]:
            return {"JobId": parts[0], "JobState": parts[1].split()[0], "ExitCode": parts[2]}
    return {}


def _code_from_state(state: str, exit_code: str | None) -> int:
    if state == "COMPLETED":
        return 0
    code, _, sig = (exit_code or "").partition(":")
    if code.isdigit() and int(code):
        return int(code)
    if sig.isdigit() and int(sig):
        return 128 + int(sig)
    return STATE_EXIT_CODES.get(state, UNKNOWN_JOB_EXIT_CODE)


def decide(job_id: str, fields: dict[str, str], recorded_exit: int | None) -> JobStatus:
    """One status from scontrol/sacct fields and the exit status the batch script recorded.

    The script's record wins when present (it is srun's status, known even after Slurm
    forgot the job); otherwise the state's exit code; a job Slurm does not know and that
    left no record is reported done and failed, since nothing will ever change.
    """
    state = fields.get("JobState", "")
    reason = fields.get("Reason", "")
    if state and state not in TERMINAL_STATES:
        return JobStatus(state, done=False, reason=reason)
    if recorded_exit is not None:
        if not state:
            state = "COMPLETED" if recorded_exit == 0 else "FAILED"
        return JobStatus(state, done=True, exit_code=recorded_exit, reason=reason)
    if state:
        return JobStatus(state, done=True, exit_code=_code_from_state(state, fields.get("ExitCode")), reason=reason)
    return JobStatus("UNKNOWN", done=True, exit_code=UNKNOWN_JOB_EXIT_CODE,
                     reason="Slurm no longer knows the job and it left no exit record")


def read_exit_record(run_dir: str, slurm_job_id: str) -> int | None:
    try:
        with open(exit_path(run_dir, slurm_job_id), encoding="utf-8") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def parse_job_id(sbatch_stdout: str) -> str:
    """``sbatch --parsable`` prints ``ID`` or ``ID;cluster``."""
    first = sbatch_stdout.strip().splitlines()[0] if sbatch_stdout.strip() else ""
    job_id = first.split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise LaunchError(f"sbatch did not print a job id: {sbatch_stdout.strip()!r}", 1)
    return job_id


# argv builders shared by the backend (sync) and the trigger (async)
def show_job_argv(job_id: str) -> list[str]:
    return ["scontrol", "show", "job", "-o", job_id]


def sacct_argv(job_id: str) -> list[str]:
    return ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode"]


def cancel_argv(job_id: str) -> list[str]:
    return ["scancel", "--full", job_id]


def sbatch_argv(script: str) -> list[str]:
    return ["sbatch", "--parsable", script]


def fields_or_raise(job_id: str, returncode: int, stdout: str, stderr: str) -> dict[str, str]:
    """scontrol's fields; {} when Slurm no longer knows the job; DTrainError when the controller
    could not be asked (a restarting slurmctld is not a failed job: the caller asks again)."""
    if returncode == 0:
        return parse_scontrol_job(stdout)
    if "Invalid job id" in stderr or "Invalid job id" in stdout:
        return {}
    raise DTrainError(f"scontrol show job {job_id} failed (exit {returncode}): {stderr.strip()[-300:]}")
