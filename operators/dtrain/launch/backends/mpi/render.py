"""distribution=mpi (AzureML's MpiDistribution, Horovod style): render the mpirun command. Pure.

One mpirun starts every rank itself, per process (process count per instance =
``procs_per_node``, instance count = ``nodes``), each through the per-rank wrapper
``dtrain.launch.rank_entry``, which maps OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/
LOCAL_SIZE to RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and NODE_RANK
(= rank // local size). MASTER_ADDR/MASTER_PORT and the job's variables travel
with ``-x NAME`` (the value comes from mpirun's own environment), so no value,
secret or not, is ever in an argv.

User options (SageMaker's ``custom_mpi_options``) are tokenized, not shell-parsed,
and checked against an allow-list: options that make mpirun execute a program of
the caller's choosing (``--launch-agent``, ``--mca plm_rsh_agent``, ``--prefix``)
would turn a UI parameter into code execution, so they are refused.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any, Sequence

from dtrain.errors import SpecError
from dtrain.launch.torchrun import RANK_ENTRY

MPIRUN = "mpirun"
FLAG_OPTIONS = frozenset({
    "--oversubscribe", "--nooversubscribe", "--report-bindings", "--tag-output", "--timestamp-output",
    "--display-map", "--display-allocation", "--use-hwthread-cpus", "-v", "--verbose", "-q", "--quiet",
})
VALUE_OPTIONS = frozenset({"-x", "--bind-to", "--map-by", "--rank-by", "--cpus-per-proc", "--cpus-per-rank"})
MCA_OPTIONS = frozenset({"--mca", "--gmca"})
# MCA parameters that name a program to run or where programs are found.
MCA_DENY = ("agent", "prefix", "plm_rsh", "launch", "exec", "debugger", "orted")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(=.*)?$", re.S)
MCA_KEY_RE = re.compile(r"^[a-z0-9_]+$")
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
ALLOWED_TEXT = ("-x NAME[=VALUE], --mca/--gmca KEY VALUE (not launch agents or prefixes), "
                f"{', '.join(sorted(VALUE_OPTIONS - {'-x'}))} VALUE, or a flag among {', '.join(sorted(FLAG_OPTIONS))}")


def _long(token: str) -> str:
    """OpenMPI accepts ``-mca`` and ``--mca`` alike; compare in the double-dash form."""
    if token.startswith("-") and not token.startswith("--") and len(token) > 2:
        return "-" + token
    return token


def coerce_mpi_options(value: Any) -> list[str]:
    """Tokens of the user's mpirun options. Each item is split like a command line (no shell
    runs: quotes only group words), so ``'-x NCCL_DEBUG=VERSION'`` gives two tokens."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise SpecError("mpi_options", value, "a list of mpirun options, e.g. ['-x NCCL_DEBUG=VERSION', '--oversubscribe']")
    tokens: list[str] = []
    for item in items:
        try:
            tokens.extend(shlex.split(item))
        except ValueError as e:
            raise SpecError("mpi_options", item, f"balanced quotes ({e})") from e
    _check_tokens(tokens)
    return tokens


def _check_tokens(tokens: list[str]) -> None:
    i = 0
    while i < len(tokens):
        option = _long(tokens[i])
        if option in FLAG_OPTIONS:
            i += 1
            continue
        if option in VALUE_OPTIONS:
            if i + 1 >= len(tokens):
                raise SpecError("mpi_options", tokens[i], "a value after it")
            if option == "-x" and not ENV_NAME_RE.match(tokens[i + 1]):
                raise SpecError("mpi_options", tokens[i + 1], "-x NAME or -x NAME=VALUE")
            i += 2
            continue
        if option in MCA_OPTIONS:
            if i + 2 >= len(tokens):
                raise SpecError("mpi_options", " ".join(tokens[i:]), f"{tokens[i]} KEY VALUE")
            key = tokens[i + 1]
            if not MCA_KEY_RE.match(key) or any(bad in key for bad in MCA_DENY):
                raise SpecError("mpi_options", f"{tokens[i]} {key}",
                                "an MCA parameter that does not choose a program to run (no *agent*, *prefix*, plm_rsh*)")
            i += 3
            continue
        raise SpecError("mpi_options", tokens[i], ALLOWED_TEXT)


def mpirun_argv(*, nodes: int, procs_per_node: int, python: str, command: Sequence[str], export: Sequence[str],
                hostfile: str | None = None, rsh_agent: str | None = None, workdir: str | None = None,
                user_options: Sequence[str] = (), mpirun: str = MPIRUN) -> list[str]:
    """The mpirun argv: ``nodes`` x ``procs_per_node`` ranks, ``procs_per_node`` on each node.

    ``hostfile`` None runs on this host only (``--host localhost:P``). ``rsh_agent`` is how
    mpirun reaches the hosts (our generated ``ssh -F config``). ``export`` names the variables
    to forward to every rank (values from mpirun's environment). ``user_options`` come last
    before the program, so a user's ``--bind-to`` overrides ours.
    """
    argv = [mpirun]
    if hostfile is None:
        argv += ["--host", f"localhost:{nodes * procs_per_node}"]
    else:
        argv += ["--hostfile", hostfile]
    argv += ["-np", str(nodes * procs_per_node), "--map-by", f"ppr:{procs_per_node}:node",
             # Horovod's advice: let the framework's threads use the cores; binding hurts DDP on CPU.
             "--bind-to", "none"]
    if rsh_agent is not None:
        argv += ["--mca", "plm_rsh_agent", rsh_agent]
    if workdir is not None:
        argv += ["--wdir", workdir]
    for name in export:
        argv += ["-x", name]
    argv += list(user_options)
    argv += [python, *RANK_ENTRY, *command]
    return argv


def mpirun_env(base: dict[str, str], *, euid: int | None = None) -> dict[str, str]:
    """mpirun's own environment: OpenMPI refuses to run as root unless both variables say yes.
    Set only for root, where they are needed (containers, CI); never otherwise."""
    env = dict(base)
    if (os.geteuid() if euid is None else euid) == 0:
        env.update(ROOT_ENV)
    return env
