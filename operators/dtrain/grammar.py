"""The grammar of every value that reaches a shell script, a remote command or a file name.

One place, used by every backend and capability: each check is a full match (``re.fullmatch``,
so ``$`` can never match before a trailing newline) against an allow-list alphabet, and a
refusal is a :class:`~dtrain.errors.SpecError` naming the field, the value and what is allowed
(exit status 2 from the CLI, before anything is created).
"""

from __future__ import annotations

import math
import re
from typing import Any

from dtrain.errors import SpecError

#: a POSIX shell variable name: what ``export NAME=...`` and ``env`` accept unquoted
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: names safe in an #SBATCH line or a job/account name
NAME = re.compile(r"[A-Za-z0-9_.+-]{1,128}")
#: a Slurm partition, or a comma-separated list of them
PARTITION = re.compile(r"[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64})*")
#: Slurm's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; or UNLIMITED/INFINITE
SLURM_TIME = re.compile(r"\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d{1,2}|\d+-\d{1,2}:\d{1,2}"
                        r"|\d+-\d{1,2}:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE")
#: an absolute path that needs no quoting in a line another program parses itself
PLAIN_PATH = re.compile(r"/[A-Za-z0-9_./+@:=,-]*")
#: an option value in a safe alphabet (no quotes, blanks, $, newline)
OPTION_VALUE = re.compile(r"[A-Za-z0-9_.,:=@/+%-]+")
#: a long option as written, ``--name`` or ``--name=value`` (groups: name, value)
LONG_OPTION = re.compile(r"--([a-z][a-z0-9-]*)(?:=(" + OPTION_VALUE.pattern + "))?")
#: a node list (Slurm's --nodelist/--exclude): names only; with a "/" Slurm reads a file instead
NODE_LIST = re.compile(r"[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64})*")
#: one line of a command (a path to an interpreter...): no control character, newline or NUL
COMMAND_LINE = re.compile(r"[^\x00-\x1f\x7f]+")
#: an MCA value: a component list ("^openib", "self,tcp"), an interface or CIDR list, a policy
#: ("core:overload-allowed", "ppr:2:node:PE=4"), a device glob ("mlx5_*"), a number or a boolean;
#: never starting with "-" (it would read as an option)
MCA_VALUE = re.compile(r"\^?[A-Za-z0-9_*][A-Za-z0-9_.,:/*=+-]*")
#: the value of mpirun's --bind-to/--map-by/--rank-by ("none", "ppr:4:node:PE=2")
POLICY_VALUE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.,:=+-]*")
#: a small positive count (mpirun's --cpus-per-proc)
COUNT_VALUE = re.compile(r"[1-9][0-9]{0,3}")
#: a per-job secret (32 random bytes as lowercase hex): keys the MAC of records a daemon writes
SECRET = re.compile(r"[0-9a-f]{64}")

#: an argument that a remote shell reads through DeepSpeed's PDSH runner (multi-node autotuning).
#: DeepSpeed 0.19 joins the argv with spaces into one ssh command line and only wraps an argument
#: holding a space in double quotes, so every character here means itself to sh, bare and between
#: double quotes; ``%`` is left out too (pdsh substitutes ``%n``, ``%h``, ``%u``)
REMOTE_ARG = re.compile(r"[A-Za-z0-9_./:=,@+ -]+")
#: an environment value that DeepSpeed's PDSH runner writes into that line as ``export K=V;``
#: (double-quoted when it holds anything but ``[\w@%+=:,./-]``, with nothing escaped)
REMOTE_ENV_VALUE = re.compile(r"[A-Za-z0-9_./:=,@+^ -]*")
#: a command-line flag, e.g. ``--micro-batch`` (what autotuning.arg_mappings maps a config key to)
FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_.-]*")

#: the most nodes a job may have (a launch, DeepSpeed's autotuner, the throughput planner)
MAX_NODES = 4096

#: variables of the environment contract and of the launcher: set per rank, never by the user
CONTRACT_VARIABLES = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID", "TF_CONFIG", "AZ_BATCH_MASTER_NODE",
})
CONTRACT_PREFIXES = ("DTRAIN_", "OMPI_COMM_WORLD_", "PET_", "SLURM_")


#: MLflow names we create or look up: a registered model, an experiment (dtrain.mlflow.tracking). Quoted
#: in MLflow's search filters as '<name>', so no quote, backslash or control character may occur
MLFLOW_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+ -]{0,255}")
#: a model-version alias: MLflow's own rule (letters, digits, _ and -), and not ``latest`` or ``v<N>``,
#: which MLflow reserves for version references
MLFLOW_ALIAS = re.compile(r"(?!latest$)(?![vV][0-9]+$)[A-Za-z0-9_-]{1,255}")
#: an MLflow run id (32 hex digits) and a model version number, as read back from XCom or a server
MLFLOW_RUN_ID = re.compile(r"[0-9a-f]{32}")
MLFLOW_VERSION = re.compile(r"[1-9][0-9]{0,9}")
#: where an MLflow tracking server is reached: http(s), a host, optionally a port and a path
MLFLOW_URI = re.compile(r"https?://[A-Za-z0-9._\[\]:-]+(?:/[A-Za-z0-9._~/-]*)?")


_USER = r"[A-Za-z_][A-Za-z0-9._-]{0,63}"
# A name or IPv4 address (never starting with '-': it would read as an ssh option), or [IPv6].
_HOST = r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252}[A-Za-z0-9])?"
#: a hostfile line's target, ``[user@]host[:port]`` (the ssh backend's hostfiles, autotune's hosts)
HOST_TARGET = re.compile(rf"^(?:(?P<user>{_USER})@)?(?P<host>{_HOST})(?::(?P<port>[0-9]{{1,5}}))?$")
HOST_USER = re.compile(rf"^{_USER}$")


def check(field: str, value: Any, pattern: re.Pattern, allowed: str) -> str:
    """``value`` as text if all of it matches ``pattern``, else SpecError naming field, value, allowed."""
    text = value if isinstance(value, str) else str(value)
    if pattern.fullmatch(text) is None:
        raise SpecError(field, value, allowed)
    return text


def env_name(field: str, name: Any) -> str:
    """A variable name a user may set for the ranks: shell grammar, and not a contract variable."""
    if not isinstance(name, str):
        raise SpecError(field, name, "a variable name (text)")
    check(field, name, ENV_NAME, "a variable name: a letter or _, then letters, digits or _ "
                                 "(^[A-Za-z_][A-Za-z0-9_]*$)")
    if name in CONTRACT_VARIABLES or name.startswith(CONTRACT_PREFIXES):
        raise SpecError(field, name, "a variable the launcher does not set itself (the env contract: "
                                     f"{', '.join(sorted(CONTRACT_VARIABLES))} and {', '.join(CONTRACT_PREFIXES)}*)")
    return name


def env_value(field: str, value: Any) -> str:
    """A variable's value: any text but NUL (which no environment can hold)."""
    text = str(value)
    if "\0" in text:
        raise SpecError(field, "<not shown>", "a value without NUL characters")
    return text


def finite(field: str, value: Any, *, minimum: float, maximum: float) -> float:
    """A finite number within [minimum, maximum] (NaN and the infinities are refused)."""
    if isinstance(value, bool):
        raise SpecError(field, value, "a number, not a boolean")
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError) as e:
        raise SpecError(field, value, "a number") from e
    if not math.isfinite(number) or not minimum <= number <= maximum:
        raise SpecError(field, value, f"a finite number between {minimum:g} and {maximum:g}")
    return number


#: where checkpoints go: an absolute local path (the shared filesystem) or an s3:// prefix (bucket
#: names as S3 allows them; key parts in a plain alphabet, never "." or "..")
_KEY_PART = r"(?!\.\.?(?:/|$))[A-Za-z0-9_.=+@,-]{1,255}"
CHECKPOINT_URL = re.compile(rf"s3://(?P<bucket>[a-z0-9][a-z0-9.-]{{1,61}}[a-z0-9])(?P<key>(?:/{_KEY_PART})*)/?")
CHECKPOINT_PATH = re.compile(rf"/(?:{_KEY_PART}/?)*")


def checkpoint_location(field: str, value: Any) -> str:
    """A checkpoint location: an absolute local path or ``s3://bucket/prefix``, without a trailing "/"."""
    if isinstance(value, str) and (CHECKPOINT_URL.fullmatch(value) or CHECKPOINT_PATH.fullmatch(value)):
        return value.rstrip("/") or "/"
    raise SpecError(field, value, "an absolute path or s3://bucket/prefix (letters, digits and _.=+@,- in each "
                                  "part; no '.' or '..' part)")
