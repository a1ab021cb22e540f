"""Slurm, the pure part: options, the sbatch script, and the reading of Slurm's answers.

Split torchx-style into this pure module and :mod:`.backend`, which talks to Slurm:

* :class:`SlurmOptions` (validated: partition, time limit, account, ...) and
  :func:`render_sbatch` turn a prepared :class:`~dtrain.launch.core.job.Job` into the exact
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

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from dtrain import grammar
from dtrain.args import coerce_float, mapping_arg
from dtrain.errors import DTrainError, LaunchError, SpecError
from dtrain.launch.backends.base import JobStatus, contract_node_env
from dtrain.launch.core.job import Job
from dtrain.launch.core.lost import DEFAULT_LOST_AFTER_S, MIN_LOST_AFTER_S
from dtrain.options import Check, Option, Options, integer
from dtrain.launch.core.torchrun import Elastic, Static, agent_argv
from dtrain.rundir import RunDir

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

# Every long option of sbatch (Slurm 22.05.8, the version installed here), as its getopt_long
# sees them: listed by asking the real sbatch about every prefix ("sbatch --ex=1 --wrap true" ->
# "option '--ex=1' is ambiguous; possibilities: '--exclude' '--exclusive' '--export'
# '--export-file' '--extra-node-info'", then longer prefixes until each resolved). Used only to
# resolve an abbreviation the way sbatch does; what a user may add is EXTRA_SBATCH_ALLOWED.
SBATCH_LONG_OPTIONS = frozenset({
    "account", "acctg-freq", "array", "batch", "bb", "bbf", "begin", "chdir", "cluster",
    "cluster-constraint", "clusters", "comment", "constraint", "container", "context", "contiguous",
    "core-spec", "cores-per-socket", "cpu-freq", "cpus-per-gpu", "cpus-per-task", "deadline", "delay-boot",
    "dependency", "distribution", "error", "exclude", "exclusive", "export", "export-file",
    "extra-node-info", "get-user-env", "gid", "gpu-bind", "gpu-freq", "gpus", "gpus-per-node",
    "gpus-per-socket", "gpus-per-task", "gres", "gres-flags", "help", "hint", "hold", "ignore-pbs", "input",
    "job-name", "kill-on-invalid-dep", "licenses", "mail-type", "mail-user", "mcs-label", "mem", "mem-bind",
    "mem-per-cpu", "mem-per-gpu", "mincpus", "network", "nice", "no-kill", "no-requeue", "nodefile",
    "nodelist", "nodes", "ntasks", "ntasks-per-core", "ntasks-per-gpu", "ntasks-per-node",
    "ntasks-per-socket", "ntasks-per-tres", "open-mode", "output", "overcommit", "oversubscribe", "parsable",
    "partition", "power", "prefer", "priority", "profile", "propagate", "qos", "quiet", "reboot", "requeue",
    "reservation", "signal", "sockets-per-node", "spread-job", "switches", "tasks-per-node", "test-only",
    "thread-spec", "threads-per-core", "time", "time-min", "tmp", "uid", "usage", "use-min-nodes", "verbose",
    "version", "wait", "wait-all-nodes", "wckey", "wrap",
})
# What a job may add with extra_sbatch (the resolved name -> whether it takes a value: "required",
# "optional" or "none", as sbatch's getopt_long table says). Only scheduling requests and labels:
# nothing that changes the output/error/input files, the working directory, the environment
# export, the script or a job array, the user/group, the cluster the job goes to, sbatch's own
# output (which the backend parses) or its blocking, nor anything naming a file or a program
# (--export-file, --bbf, --container, --nodefile, ...), nor the layout the backend sets itself
# (nodes, tasks, GPUs per node, partition, time, account, job name).
EXTRA_SBATCH_ALLOWED = {
    "begin": "required", "comment": "required", "constraint": "required", "contiguous": "none",
    "cores-per-socket": "required", "cpus-per-gpu": "required", "cpus-per-task": "required",
    "deadline": "required", "dependency": "required", "exclude": "required", "exclusive": "optional",
    "gpus": "required", "gres": "required", "gres-flags": "required", "hint": "required",
    "kill-on-invalid-dep": "required", "licenses": "required", "mail-type": "required", "mem": "required",
    "mem-per-cpu": "required", "mem-per-gpu": "required", "mincpus": "required", "nice": "optional",
    "no-requeue": "none", "nodelist": "required", "prefer": "required", "qos": "required",
    "requeue": "none", "reservation": "required", "signal": "required", "sockets-per-node": "required",
    "switches": "required", "threads-per-core": "required", "time-min": "required", "tmp": "required",
    "wckey": "required",
}
# Options the backend writes itself (named in a refusal, so the user knows why).
BACKEND_SBATCH = ("job-name", "nodes", "ntasks-per-node", "gpus-per-node", "time", "partition", "account",
                  "output", "parsable")
# An extra option as written, --name[=value]; every rendered #SBATCH directive is re-checked with
# the same grammar at render time (a Job or options built by hand); node lists hold names only;
# the interpreter on the nodes is shlex.quote'd in the script, but one line of it.
_EXTRA = _DIRECTIVE = grammar.LONG_OPTION
_NODE_LIST, _COMMAND = grammar.NODE_LIST, grammar.COMMAND_LINE
_EXTRA_ALLOWED_TEXT = ("one of " + ", ".join(f"--{name}" for name in sorted(EXTRA_SBATCH_ALLOWED))
                       + ", written --option or --option=value (letters, digits, _ . , : = @ / + % -); "
                       "an abbreviation is read the way sbatch reads it")


def resolve_sbatch_option(name: str, item: str) -> str:
    """The sbatch long option ``name`` means, the way getopt_long resolves it: an exact name wins,
    else the one option it is a prefix of. An unknown or ambiguous name is a SpecError."""
    if name in SBATCH_LONG_OPTIONS:
        return name
    matches = sorted(option for option in SBATCH_LONG_OPTIONS if option.startswith(name))
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise SpecError("extra_sbatch", item, f"an unambiguous option: sbatch reads --{name} as any of "
                                              f"{', '.join('--' + m for m in matches)}; allowed: {_EXTRA_ALLOWED_TEXT}")
    raise SpecError("extra_sbatch", item, f"an sbatch option (--{name} is none); allowed: {_EXTRA_ALLOWED_TEXT}")


def check_extra_sbatch(item: Any) -> str:
    """One extra_sbatch entry, resolved and checked; returned with the option's full name, so
    the script says exactly what sbatch reads whatever its version's other options."""
    if not isinstance(item, str):
        raise SpecError("extra_sbatch", item, f"text: {_EXTRA_ALLOWED_TEXT}")
    grammar.check("extra_sbatch", item, _EXTRA, _EXTRA_ALLOWED_TEXT)
    match = _EXTRA.fullmatch(item)
    name, value = match.group(1), match.group(2)
    option = resolve_sbatch_option(name, item)
    takes = EXTRA_SBATCH_ALLOWED.get(option)
    if takes is None:
        why = ("which the backend sets itself" if option in BACKEND_SBATCH
               else "which is not among the options a job may add")
        raise SpecError("extra_sbatch", item, f"sbatch reads it as --{option}, {why}; allowed: {_EXTRA_ALLOWED_TEXT}")
    if takes == "required" and value is None:
        raise SpecError("extra_sbatch", item, f"--{option}=VALUE (it takes a value)")
    if takes == "none" and value is not None:
        raise SpecError("extra_sbatch", item, f"--{option} without a value")
    if option in ("nodelist", "exclude"):
        grammar.check("extra_sbatch", value, _NODE_LIST,
                      f"--{option}=NODE[,NODE...] (letters, digits, _ . -; no '/', which makes Slurm read a file)")
    return f"--{option}" if value is None else f"--{option}={value}"


def _name(pattern: re.Pattern, allowed: str) -> Check:
    """A name matching ``pattern``; blank is none (surrounding blanks, a rendered template's, are dropped)."""
    def check(name: str, value: Any) -> Any:
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        return grammar.check(name, str(value).strip(), pattern, allowed)
    return check


def _extra_sbatch(name: str, value: Any) -> tuple[str, ...]:
    try:
        extra = [value] if isinstance(value, str) else list(value or ())
    except TypeError as e:
        raise SpecError(name, value, "a list of --option[=value] strings") from e
    return tuple(check_extra_sbatch(item) for item in extra)


def _python(name: str, value: Any) -> str:
    if not str(value).strip():
        raise SpecError(name, value, "a path to the Python interpreter on the compute nodes")
    return grammar.check(name, value, _COMMAND, "a path to the Python interpreter on the compute nodes "
                                                "(no newline, NUL or other control character)")


def _poll_interval(name: str, value: Any) -> float:
    try:
        poll = float(value)
    except (TypeError, ValueError) as e:
        raise SpecError(name, value, "a number of seconds") from e
    if not 0.05 <= poll <= 3600:
        raise SpecError(name, value, "between 0.05 and 3600 seconds")
    return poll


#: the slurm backend's options (its ``backend_options``), declared once: its ``dtrain launch`` flags, the
#: checks of :class:`SlurmOptions` and the slurm table of docs/backends.md come from here
SLURM_OPTIONS = Options([
    Option("partition", str, None, "Slurm partition (-p); default: the cluster's default partition",
           check=_name(grammar.PARTITION, "a Slurm partition name (letters, digits, _ . -), or a comma-separated list")),
    Option("time_limit", str, None, "time limit in Slurm's format (90, 1:30:00, 2-00:00:00)", flag="--time",
           check=_name(grammar.SLURM_TIME, "a Slurm time: minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S or UNLIMITED")),
    Option("account", str, None, "Slurm account to charge",
           check=_name(grammar.NAME, "an account name (letters, digits, _ . + -)")),
    Option("gpus_per_node", int, None, "GPUs requested per node (--gpus-per-node); default: the job's gpus_per_node "
                                       "when it uses GPUs, else none", check=integer(0, 1024), flag=None),
    Option("job_name", str, None, "--job-name; default: the job id",
           check=_name(grammar.NAME, "a job name (letters, digits, _ . + -)"), flag=None),
    Option("python", str, None, "the interpreter on the compute nodes (default: this one's path)", check=_python,
           flag=None),
    Option("extra_sbatch", list[str], (), "an extra sbatch option such as --qos=high or --exclusive (repeatable)",
           check=_extra_sbatch, flag="--sbatch-option", cli={"action": "append", "metavar": "--OPT[=VALUE]"}),
    Option("poll_interval", float, 2.0, "seconds between job state polls", check=_poll_interval,
           flag="--slurm-poll-interval"),
    Option("master_port", int, 0, "rendezvous port on the first node; 0: 20000 + the Slurm job id % 20000",
           check=integer(0, 65535), flag=None),
    Option("lost_after", float, DEFAULT_LOST_AFTER_S, "seconds (>= 10; default 30) after which a node cut off from its "
                                                      "peer fences itself and a silent node counts as lost",
           check=lambda name, value: coerce_float(name, value, minimum=MIN_LOST_AFTER_S, maximum=3600.0),
           flag="--slurm-lost-after"),
], title="slurm backend (--backend slurm)")


@dataclass(frozen=True)
@SLURM_OPTIONS.fields()
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
        lost_after: seconds (at least 10; default 30) after which a node that cannot reach the next
            node's slurmd or its own, or was frozen, fences itself (stops its ranks), and a node whose
            heartbeat is that old counts as lost (:mod:`.lost`): Slurm's own SlurmdTimeout is minutes.
    """

    # its fields: one keyword-only field per option of SLURM_OPTIONS (SLURM_OPTIONS.fields)

    def __post_init__(self) -> None:
        for name in SLURM_OPTIONS.names:  # frozen: normalised in place once, checked as SLURM_OPTIONS declares
            object.__setattr__(self, name, SLURM_OPTIONS.check(name, getattr(self, name)))


def coerce_options(options: "SlurmOptions | Mapping[str, Any] | str | None" = None) -> "SlurmOptions":
    """A :class:`SlurmOptions` from an operator argument: None, a dict (templated) or the object."""
    if options is None:
        return SlurmOptions()
    if isinstance(options, SlurmOptions):
        return options
    options = mapping_arg("slurm_options", options, not_json="a mapping (or a JSON object string)",
                          not_mapping="a mapping of SlurmOptions fields")
    allowed = set(SLURM_OPTIONS.names)
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


def node_exit_path(run_dir: str, slurm_job_id: str, node: int) -> str:
    """Where an elastic job's node records its agent's exit status (:data:`ELASTIC_NODE_SHELL`)."""
    return os.path.join(run_dir, f"slurm-{slurm_job_id}.node{int(node)}.exit")


def stop_path(run_dir: str, slurm_job_id: str) -> str:
    """Written by the launcher before it SIGTERMs the job's steps (a stop it will end with a cancel)."""
    return os.path.join(run_dir, f"slurm-{slurm_job_id}.stop")


#: how long the batch script waits for the launcher's cancel after a stop the launcher asked for
STOP_CANCEL_WAIT_S = 30


def requested_gpus(job: Job, options: SlurmOptions) -> int:
    if options.gpus_per_node is not None:
        return options.gpus_per_node
    spec = job.spec
    if spec.placement.device == "cpu" or not spec.placement.gpus_per_node:
        return 0
    return spec.placement.gpus_per_node


def check_run_dir(run_dir: str) -> None:
    grammar.check("run_dir", run_dir, grammar.PLAIN_PATH,
                  "for the slurm backend, an absolute path of letters, digits and _ . / + @ : = , - "
                  "(it appears on an #SBATCH --output line)")


def node_argv(job: Job, python: str, rdzv: Elastic | None = None) -> list[str]:
    """torchrun for one node, static rendezvous: Slurm fixes membership; the endpoint and node rank
    come at run time from PET_MASTER_ADDR/PORT and PET_NODE_RANK (= SLURM_NODEID) per node. An elastic
    job's (``rdzv``): at the launcher's store, each node naming the address it reaches it from."""
    return agent_argv(job.spec, python=python, job_id=job.job_id, rdzv=rdzv or Static())


# Runs inside every srun task: the per-node values exist only there. A constant: no user value in it.
# The agent runs as a child rather than by exec, so that when it ends (or scancel's SIGTERM
# arrives) whatever the job left on this node outside the agent's tree (a rank's setsid child,
# re-parented to init) is stopped by the job id and node index it carries: slurmd's
# proctrack/linuxproc follows parent links and would lose it. The agent dies with this shell
# (DTRAIN_AGENT_PARENT: dtrain.launch.node.proctree.die_with_parent), also when scancel SIGKILLs
# the shell, so that no trap runs. "$1" is the agent's interpreter. Beside the agent the node holds
# its lease (.node_lease: it beats, and fences the node when it cannot reach the next node's slurmd,
# or its own slurmd stops answering); the reap stops it with the rest.
_RANK_EXPORTS = ('export NODE_RANK="$SLURM_NODEID" DTRAIN_NODE_INDEX="$SLURM_NODEID" PET_NODE_RANK="$SLURM_NODEID" '
                 'PET_MASTER_ADDR="$MASTER_ADDR" PET_MASTER_PORT="$MASTER_PORT"; ')
# The node's secrets (:func:`node_secrets`) are the first line on its stdin (srun's, from the batch shell);
# the lease holder gets them on its own stdin (printf is a builtin: no argv carries them); the variable
# is never exported, and unset once the holder started.
_LEASE = ('printf \'%s\\n\' "$node_secrets" | '
          '"$py" -m dtrain.launch.backends.slurm.node_lease --run-dir "$DTRAIN_RUN_DIR" --node "$SLURM_NODEID" '
          '--job-id "$DTRAIN_JOB_ID" --lease "$DTRAIN_LOST_AFTER"')


def _node_shell(exports: str, lease: str, on_end: str = "", functions: str = "", agent_stdin: str = "") -> str:
    return (exports + 'py="$1"; node_secrets=; IFS= read -r node_secrets; '
            'reap() { "$py" -m dtrain.launch.node.proctree reap "$DTRAIN_JOB_ID" --node "$SLURM_NODEID"; }; '
            + functions + lease + ' & '
            'DTRAIN_AGENT_PARENT=$$ "$@" ' + agent_stdin + '& agent=$!; unset node_secrets; '
            'trap \'kill -TERM "$agent" 2>/dev/null; wait "$agent"; reap; exit 143\' TERM INT HUP; '
            'wait "$agent"; status=$?; reap; ' + on_end + 'exit "$status"')


NODE_SHELL = _node_shell(_RANK_EXPORTS, _LEASE)
# An elastic job's node: its rank comes from each round; its lease holds against the launcher's rendezvous
# store (its peers may come and go); and its agent's exit status is recorded per node (:func:`node_exit_path`),
# since srun waits for a lost node until Slurm declares it down (SlurmdTimeout, minutes). Its agent
# reads the node's secrets line on its stdin too (a pipe from the builtin printf: no argv, no file), for
# the rendezvous key (``secret``: :func:`dtrain.launch.node.rdzv_auth.read_secret`).
ELASTIC_NODE_SHELL = _node_shell(
    'export DTRAIN_NODE_INDEX="$SLURM_NODEID"; ', _LEASE + ' --peer "$DTRAIN_LEASE_PEER"', 'record "$status"; ',
    'record() { tmp=$(mktemp "$DTRAIN_RUN_DIR/.slurm-$SLURM_JOB_ID.node$SLURM_NODEID.XXXXXX") && echo "$1" > "$tmp" '
    '&& mv -f "$tmp" "$DTRAIN_RUN_DIR/slurm-$SLURM_JOB_ID.node$SLURM_NODEID.exit"; }; ',
    agent_stdin='< <(printf \'%s\\n\' "$node_secrets") ')

_ADDR_FUNCTION = """\
# A node's address: its NodeAddr in slurm.conf, else DNS; node names need not resolve.
dtrain_node_addr() {
  local addr
  addr=$(scontrol show node -o "$1" 2>/dev/null | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')
  if [ -z "$addr" ]; then addr=$(getent hosts "$1" | awk '{print $1; exit}'); fi
  printf '%s\\n' "${addr:-$1}"
}"""


#: the variable of sbatch's environment that carries the nodes' secrets (:func:`node_secrets`) to the batch
#: shell, which takes it out before it starts anything (:data:`_SECRETS_LINES`)
NODE_SECRETS_ENV = "DTRAIN_NODE_SECRETS"
# The batch shell re-executes itself without the variable (its first environment is what
# /proc/<pid>/environ shows for good), the line kept on a pipe; srun hands the line to every node's
# shell on stdin (--input=all), and no process below the batch shell carries it in its environment.
_SECRETS_LINES = (
    f'if [ -n "${{{NODE_SECRETS_ENV}+x}}" ]; then exec 3<<<"${NODE_SECRETS_ENV}"; '
    f'exec env -u {NODE_SECRETS_ENV} /bin/bash "$0" "$@"; fi',
    'node_secrets=; { IFS= read -r node_secrets <&3; exec 3<&-; } 2>/dev/null',
)


def node_secrets(lease_key: str, rdzv_secret: str | None = None) -> str:
    """The one line of secrets every node of the job reads on stdin: a JSON object (the lease holder's
    ``lease_key``: :func:`dtrain.launch.node.lease.read_key`; an elastic job's agent's ``secret``, its
    rendezvous key: :func:`dtrain.launch.node.rdzv_auth.read_secret`)."""
    return json.dumps({"lease_key": lease_key, **({"secret": rdzv_secret} if rdzv_secret else {})},
                      separators=(",", ":"))


def export_line(name: str, value: str) -> str:
    """``export NAME=VALUE`` for the script. The name is not quoted (a shell cannot quote one), so
    it is checked against the shell grammar of a name here too, whatever built the Job; the value
    is quoted, and NUL (which no environment can hold) is refused."""
    grammar.check("env key", name, grammar.ENV_NAME, "a variable name: a letter or _, then letters, digits or _ "
                                                     "(^[A-Za-z_][A-Za-z0-9_]*$)")
    return f"export {name}={shlex.quote(grammar.env_value(f'env[{name!r}]', value))}"


def render_sbatch(job: Job, options: SlurmOptions, *, workdir: str | None = None,
                  node_env: Mapping[str, str] | None = None, rdzv: Elastic | None = None) -> str:
    """The complete sbatch script for ``job``. Pure: the same inputs give the same text. ``node_env``:
    what every node gets (the backend's :meth:`~dtrain.launch.backends.base.Backend.node_env`, its
    default when None); each node adds its index from SLURM_NODEID. ``rdzv``: an elastic job's store
    (the launcher's); its job keeps its allocation when a node fails (``--no-kill``, sbatch and srun)."""
    spec = job.spec
    if spec.elastic and rdzv is None:
        raise DTrainError("an elastic job's script needs the launcher's rendezvous store (rdzv)")
    check_run_dir(job.run_dir)
    python = options.python or sys.executable
    workdir = spec.workdir or workdir or os.getcwd()
    gpus = requested_gpus(job, options)
    if not options.job_name:
        grammar.check("job_id", job.job_id, grammar.NAME, "a job id (letters, digits, _ . + -): it is the --job-name")
    directives = [
        f"--job-name={options.job_name or job.job_id}",
        f"--nodes={spec.placement.nodes}",
        *(["--no-kill"] if spec.elastic else []),
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={gpus}"] if gpus else []),
        *([f"--time={options.time_limit}"] if options.time_limit else []),
        *([f"--partition={options.partition}"] if options.partition else []),
        *([f"--account={options.account}"] if options.account else []),
        f"--output={log_path(job.run_dir, '%j')}",
        *options.extra_sbatch,
    ]
    for directive in directives:  # the options and the Job are not trusted to come validated
        grammar.check("sbatch directive", directive, _DIRECTIVE,
                      "--option or --option=value (letters, digits, _ . , : = @ / + % -) on an #SBATCH line")
    q = shlex.quote
    if node_env is None:  # the contract's default for Slurm: its nodes are machines of their own
        node_env = contract_node_env(job, None, grace=spec.stop_grace)
    # Secrets stay out of the script: sbatch's environment carries them.
    env = {name: value for name, value in node_env.items() if name not in spec.secret_env}
    if spec.elastic:
        env["DTRAIN_LEASE_PEER"] = f"{rdzv.host}:{rdzv.port}"
    exports = [export_line(name, value) for name, value in sorted(env.items())]
    port = str(options.master_port) if options.master_port else "$((20000 + SLURM_JOB_ID % 20000))"
    # a fixed job ends when one node fails; an elastic one goes on without it (and Slurm keeps its allocation)
    srun = ["srun", f"--nodes={spec.placement.nodes}", f"--ntasks={spec.placement.nodes}", "--ntasks-per-node=1",
            "--input=all",
            *(["--no-kill", "bash", "-c", ELASTIC_NODE_SHELL] if spec.elastic
              else ["--kill-on-bad-exit=1", "bash", "-c", NODE_SHELL]), "dtrain-node"]
    command = " \\\n  ".join([" ".join(q(a) for a in srun), " ".join(q(a) for a in node_argv(job, python, rdzv)),
                              '<<<"$node_secrets"'])
    if spec.elastic:
        rendezvous = [f'echo "[dtrain] slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: elastic ({spec.placement.nnodes} '
                      f'nodes), rendezvous store {rdzv.host}:{rdzv.port}"']
    else:
        rendezvous = [
            'MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            'MASTER_ADDR=$(dtrain_node_addr "$MASTER_NODE")',
            f"MASTER_PORT={port}",
            "export MASTER_ADDR MASTER_PORT",
            'echo "[dtrain] slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: rendezvous $MASTER_NODE ($MASTER_ADDR:$MASTER_PORT)"',
        ]
    exit_file = q(job.run_dir) + '/slurm-"$SLURM_JOB_ID".exit'
    stop_file = q(job.run_dir) + '/slurm-"$SLURM_JOB_ID".stop'
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "# Rendered by airflow-dtrain: srun starts one torchrun agent per node.",
        "set -uo pipefail",
        *_SECRETS_LINES,
        f"cd {q(workdir)} || exit 1",
        *exports,
        _ADDR_FUNCTION,
        f"export DTRAIN_LOST_AFTER={options.lost_after:g}",
        *rendezvous,
        command,
        "status=$?",
        # mktemp creates the temporary file exclusively: a link a rank planted is never written through.
        f'tmp=$(mktemp {q(job.run_dir)}/.slurm-"$SLURM_JOB_ID".exit.XXXXXX) && printf \'%s\\n\' "$status" > "$tmp" '
        f'&& mv -f "$tmp" {exit_file}',
        "# After a stop the launcher asked for (it SIGTERMed the ranks, which saved and exited), its cancel",
        "# ends the job, so Slurm reports it CANCELLED rather than failed; bounded in case it never comes.",
        f"if [ -e {stop_file} ]; then sleep {STOP_CANCEL_WAIT_S}; fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def script_path(job: Job) -> str:
    return os.path.join(job.run_dir, SCRIPT_NAME)


def write_script(job: Job, options: SlurmOptions, node_env: Mapping[str, str], rdzv: Elastic | None = None) -> str:
    """Render and write the script into the run directory (exclusive no-follow temp file + rename);
    returns its path. Owner-only permissions: the script carries the job's environment."""
    text = render_sbatch(job, options, node_env=node_env, rdzv=rdzv)
    return RunDir(job.run_dir).write(SCRIPT_NAME, data=text.encode(), mode=0o700)


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


#: slurmd's port when a node's line names none (Slurm's default SlurmdPort)
DEFAULT_SLURMD_PORT = 6818
_NODE_FIELD = re.compile(r"(?:^|\s)(NodeName|NodeAddr|Port)=(\S+)")


def parse_nodes(text: str) -> dict[str, tuple[str, int]]:
    """``scontrol show node -o LIST`` -> {NodeName: (NodeAddr, slurmd port)}."""
    found: dict[str, tuple[str, int]] = {}
    for line in text.splitlines():
        fields = dict(_NODE_FIELD.findall(line))
        if "NodeName" in fields:
            port = fields.get("Port", "")
            found[fields["NodeName"]] = (fields.get("NodeAddr", fields["NodeName"]),
                                         int(port) if port.isdigit() and 0 < int(port) < 65536 else DEFAULT_SLURMD_PORT)
    return found


def show_nodes_argv(node_list: str) -> list[str]:
    return ["scontrol", "show", "node", "-o", node_list]


def all_nodes_argv() -> list[str]:
    return ["scontrol", "show", "node", "-o"]


def hostnames_argv(node_list: str) -> list[str]:
    return ["scontrol", "show", "hostnames", node_list]


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


def read_node_exits(run_dir: str, slurm_job_id: str, nodes: int) -> dict[int, int]:
    """An elastic job's per-node exit records (:func:`node_exit_path`): node index -> status, each a
    small integer read without following a link (a rank can write them: they only end its own job)."""
    found = {}
    files = RunDir(run_dir)
    for node in range(nodes):
        try:
            raw = files.read(os.path.basename(node_exit_path(run_dir, slurm_job_id, node)), limit=32)
        except ValueError:
            continue
        if raw is not None and raw.strip().isdigit():
            found[node] = int(raw.strip())
    return found


def read_exit_record(run_dir: str, slurm_job_id: str) -> int | None:
    """The batch script's record of srun's status: a small integer, read without following a link."""
    try:
        raw = RunDir(run_dir).read(os.path.basename(exit_path(run_dir, slurm_job_id)), limit=32)
        return int(raw.strip()) if raw is not None and raw.strip().isdigit() else None
    except ValueError:
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


def signal_argv(job_id: str, signal_name: str = "TERM") -> list[str]:
    """Signal every step of the job (each node's shell, torchrun agent and ranks), not the batch
    script (without ``--full``), and without cancelling it: no SIGKILL follows (KillWait is for
    a cancel). How a stop gives the ranks their grace period."""
    return ["scancel", f"--signal={signal_name}", job_id]


def steps_argv(job_id: str) -> list[str]:
    return ["squeue", "-h", "-s", "-j", job_id, "-o", "%i"]


def running_steps(squeue_steps_stdout: str) -> list[str]:
    """The job's steps that run ranks: ``squeue -s`` lists ``ID.0`` ... and ``ID.batch``/``ID.extern``."""
    steps = [line.strip() for line in squeue_steps_stdout.splitlines() if line.strip()]
    return [step for step in steps if not step.endswith((".batch", ".extern"))]


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
