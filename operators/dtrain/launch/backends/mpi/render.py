"""distribution=mpi (AzureML's MpiDistribution, Horovod style): render the mpirun command. Pure.

One mpirun starts every rank itself, per process (process count per instance =
``procs_per_node``, instance count = ``nodes``), each through the per-rank wrapper
``dtrain.launch.node.rank_entry``, which maps OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/
LOCAL_SIZE to RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and NODE_RANK
(= rank // local size). MASTER_ADDR/MASTER_PORT and the job's variables travel
with ``-x NAME`` (the value comes from mpirun's own environment), so no value,
secret or not, is ever in an argv.

User options (SageMaker's ``custom_mpi_options``) are tokenized, not shell-parsed,
and checked against allow-lists: each option token is resolved the way mpirun 4.1
resolves it (exact names only) and must be a known-safe flag or value option; MCA
parameters must be in :data:`MCA_ALLOWED`; ``-x`` may not set the env contract,
OpenMPI's own variables (OMPI_MCA_* would bypass the MCA list) or code-loading ones
(LD_PRELOAD, PYTHONPATH, PATH...). Anything that could make mpirun execute a program
of the caller's choosing (``--launch-agent``, ``--mca plm_rsh_agent``, ``--mca
mca_base_param_files``, ``--prefix``) would turn a UI parameter into code execution,
so everything not listed is refused.
"""

from __future__ import annotations

import os
import shlex
from typing import Any, Sequence

from dtrain import grammar
from dtrain.errors import SpecError
from dtrain.launch.core.torchrun import RANK_ENTRY

MPIRUN = "mpirun"

# How OpenMPI 4.1's mpirun reads an option token (opal_cmd_line, checked with the real mpirun
# 4.1.4): "--NAME" and "-NAME" both name the option whose long name, single-dash name or
# one-letter short name is exactly NAME ("-mca" = "--mca", "--x" = "-x", "-oversubscribe" =
# "--oversubscribe"). Prefixes are NOT resolved ("--oversub", "--mc": unknown option), "--NAME=V"
# is not an option, and an unknown "-ab" is split into short options "-a -b". So a token is
# resolved by stripping one or two dashes and looking the rest up exactly; anything else
# (combined short options, "=" forms, three dashes, bare words) is refused.
#: options without a value: NAME (as after the dashes) -> the option it names
FLAG_NAMES = {
    "oversubscribe": "oversubscribe", "nooversubscribe": "nooversubscribe",
    "report-bindings": "report-bindings", "tag-output": "tag-output", "timestamp-output": "timestamp-output",
    "display-map": "display-map", "display-allocation": "display-allocation",
    "use-hwthread-cpus": "use-hwthread-cpus", "v": "verbose", "verbose": "verbose", "q": "quiet", "quiet": "quiet",
}
#: options with one value: NAME -> the option it names
VALUE_NAMES = {"x": "x", "bind-to": "bind-to", "map-by": "map-by", "rank-by": "rank-by",
               "cpus-per-proc": "cpus-per-proc", "cpus-per-rank": "cpus-per-rank"}
#: options with two values, KEY VALUE
MCA_NAMES = {"mca": "mca", "gmca": "gmca"}
# The double-dash spellings, for messages and for callers that compared tokens with these sets.
FLAG_OPTIONS = frozenset("-" * (1 if len(n) == 1 else 2) + n for n in FLAG_NAMES)
VALUE_OPTIONS = frozenset("-" * (1 if len(n) == 1 else 2) + n for n in VALUE_NAMES)
MCA_OPTIONS = frozenset("--" + n for n in MCA_NAMES)

#: MCA parameters a user may set, each checked in ompi_info 4.1.4 (or, for coll_hcoll_enable, in
#: the HCOLL component's documentation): component selection lists among the installed components
#: (btl, pml, mtl, coll, osc), network interface lists, mapping/binding policies and booleans. None
#: of them names a program, a file or a directory to load from: mca_base_param_files (a file of
#: more parameters, e.g. orte_fork_agent), mca_base_component_path (where .so are loaded from),
#: mca_base_env_list, *_agent, *_prefix, orte_fork_agent, plm_*, ... all stay refused because they
#: are not listed here.
MCA_ALLOWED = frozenset({
    "btl", "pml", "mtl", "coll", "osc",
    "btl_tcp_if_include", "btl_tcp_if_exclude", "oob_tcp_if_include", "oob_tcp_if_exclude", "btl_tcp_links",
    "btl_vader_single_copy_mechanism", "btl_base_warn_component_unused",
    "btl_openib_allow_ib", "btl_openib_warn_no_device_params_found",
    "hwloc_base_binding_policy", "rmaps_base_mapping_policy", "rmaps_base_ranking_policy",
    "rmaps_base_oversubscribe", "orte_base_help_aggregate", "opal_cuda_support", "mpi_cuda_support",
    "mpi_warn_on_fork", "pml_ucx_tls", "pml_ucx_devices", "coll_hcoll_enable",
})
MCA_VALUE, POLICY_VALUE, COUNT_VALUE = grammar.MCA_VALUE, grammar.POLICY_VALUE, grammar.COUNT_VALUE

# Variables -x must not set or forward, on top of grammar.env_name (the env contract):
# * OpenMPI's own configuration (OMPI_MCA_*, OPAL_*/ORTE_*, PMIx and PRRTE's): an MCA parameter
#   by environment would bypass MCA_ALLOWED (OMPI_MCA_orte_fork_agent, OPAL_PREFIX, ...);
# * what the loader, the interpreter or a shell load code from: LD_* (LD_PRELOAD,
#   LD_LIBRARY_PATH, LD_AUDIT...), PYTHON* (PYTHONPATH, PYTHONHOME, PYTHONSTARTUP,
#   PYTHONWARNINGS imports modules...), PATH, BASH_ENV/ENV, GCONV_PATH, and the plug-in
#   directories of hwloc and UCX, which OpenMPI itself loads.
# Any other variable may be set, as in the spec's ``env``.
X_DENIED_PREFIXES = ("OMPI_", "OPAL_", "ORTE_", "PMIX_", "PRTE_", "LD_", "PYTHON")
X_DENIED_NAMES = frozenset({"PATH", "BASH_ENV", "ENV", "GCONV_PATH", "HWLOC_PLUGINS_PATH", "UCX_MODULE_DIR"})
# Exported by name into mpirun's own environment too (mpirun_env): these configure mpirun itself.
MPI_RUNTIME_PREFIXES = ("OMPI_", "OPAL_", "ORTE_", "PMIX_", "PRTE_")

ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
ALLOWED_TEXT = ("-x NAME[=VALUE], --mca/--gmca KEY VALUE (KEY among the allowed MCA parameters), "
                "--bind-to/--map-by/--rank-by POLICY, --cpus-per-proc/--cpus-per-rank N, or a flag among "
                f"{', '.join(sorted(FLAG_OPTIONS))}; each spelled exactly (--NAME or -NAME; mpirun resolves "
                "no abbreviations)")
MCA_ALLOWED_TEXT = f"an allowed MCA parameter: {', '.join(sorted(MCA_ALLOWED))}"


def option_name(token: str) -> str | None:
    """The mpirun option ``token`` names, the way mpirun 4.1 reads it (exact names after one or
    two dashes; no prefixes), or None when it names none we accept."""
    if token.startswith("--"):
        name = token[2:]
    elif token.startswith("-"):
        name = token[1:]
    else:
        return None
    return FLAG_NAMES.get(name) or VALUE_NAMES.get(name) or MCA_NAMES.get(name)


def check_x_name(name: str) -> str:
    """A variable ``-x`` may set or forward: a shell name, not the env contract, not OpenMPI's own
    configuration and not a code-loading variable (X_DENIED_*)."""
    grammar.env_name("mpi_options", name)
    if name in X_DENIED_NAMES or name.startswith(X_DENIED_PREFIXES):
        raise SpecError("mpi_options", name,
                        "-x for an ordinary variable: not OpenMPI's own configuration "
                        f"({', '.join(p + '*' for p in MPI_RUNTIME_PREFIXES)}: set MCA parameters with --mca) "
                        "and not one that loads code (LD_*, PYTHON*, "
                        f"{', '.join(sorted(X_DENIED_NAMES))})")
    return name


def check_export_names(names: Sequence[str]) -> None:
    """Names exported to the ranks with ``-x NAME`` also sit in mpirun's own environment; one
    of OpenMPI's (OMPI_MCA_*...) there would configure mpirun itself and bypass MCA_ALLOWED."""
    for name in names:
        grammar.check("env key", name, grammar.ENV_NAME, "a variable name (^[A-Za-z_][A-Za-z0-9_]*$)")
        if name.startswith(MPI_RUNTIME_PREFIXES):
            raise SpecError("env key", name, "with distribution='mpi', not one of OpenMPI's own variables "
                                             f"({', '.join(p + '*' for p in MPI_RUNTIME_PREFIXES)}); "
                                             "set MCA parameters with mpi_options --mca KEY VALUE")


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
        token = tokens[i]
        option = option_name(token)
        if option is None:
            raise SpecError("mpi_options", token, ALLOWED_TEXT)
        if option in FLAG_NAMES.values():
            i += 1
            continue
        if option in MCA_NAMES:
            if i + 2 >= len(tokens):
                raise SpecError("mpi_options", " ".join(tokens[i:]), f"{token} KEY VALUE")
            key, mca_value = tokens[i + 1], tokens[i + 2]
            if key not in MCA_ALLOWED:
                raise SpecError("mpi_options", f"{token} {key}", MCA_ALLOWED_TEXT)
            grammar.check("mpi_options", mca_value, MCA_VALUE,
                          f"{token} {key} VALUE: letters, digits and _ . , : / * = + - (an optional leading ^), "
                          "not starting with -")
            i += 3
            continue
        if i + 1 >= len(tokens):
            raise SpecError("mpi_options", token, "a value after it")
        arg = tokens[i + 1]
        if option == "x":
            name, _, env_value = arg.partition("=")
            check_x_name(name)
            grammar.env_value("mpi_options", env_value)
        elif option in ("cpus-per-proc", "cpus-per-rank"):
            grammar.check("mpi_options", arg, COUNT_VALUE, f"{token} N: a count from 1 to 9999")
        else:
            grammar.check("mpi_options", arg, POLICY_VALUE,
                          f"{token} POLICY: letters, digits and _ . , : = + - (not starting with -)")
        i += 2


def mpirun_argv(*, nodes: int, procs_per_node: int, python: str, command: Sequence[str], export: Sequence[str],
                hostfile: str | None = None, rsh_agent: str | None = None, workdir: str | None = None,
                user_options: Sequence[str] = (), mpirun: str = MPIRUN) -> list[str]:
    """The mpirun argv: ``nodes`` x ``procs_per_node`` ranks, ``procs_per_node`` on each node.

    ``hostfile`` None runs on this host only (``--host localhost:P``). ``rsh_agent`` is how
    mpirun reaches the hosts (our generated ``ssh -F config``). ``export`` names the variables
    to forward to every rank (values from mpirun's environment). ``user_options`` come last
    before the program, so a user's ``--bind-to`` overrides ours.
    """
    check_export_names(export)
    _check_tokens(list(user_options))  # not trusted to have come through coerce_mpi_options
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
