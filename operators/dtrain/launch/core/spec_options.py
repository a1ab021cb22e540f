"""The job's options, declared once: :data:`JOB_OPTIONS`, the table of
:class:`~dtrain.launch.core.spec.LaunchSpec`'s fields (its placement's too).

``LaunchSpec``'s keyword-only fields (:meth:`~dtrain.options.Options.fields`), ``dtrain launch``'s flags,
:class:`~dtrain.launch.airflow.operator.DistributedTrainingOperator`'s keyword parameters and
``template_fields``, the per-field checks of the spec and its placement, and the job options table in
docs/backends.md all come from this table (:mod:`dtrain.options`). A new option is one line here.

Light on purpose: the operator reads it when a DAG file is parsed.
"""

from __future__ import annotations

from typing import Any

from dtrain import grammar
from dtrain.args import coerce_env
from dtrain.errors import SpecError
from dtrain.launch.backends.placement import DEVICES, PLACEMENT_TABLE
from dtrain.options import Option, Options, boolean, integer, number

DISTRIBUTIONS = ("pytorch", "deepspeed", "mpi", "tensorflow")
#: the default hang timeout of an operator's job (a CLI launch has none): half an hour without a printed
#: line, a metrics record or a heartbeat from a rank is almost always stuck, and gloo's/NCCL's own
#: collective timeout is as long (docs/hangs.md)
OPERATOR_HANG_TIMEOUT = 1800.0
WEEK_S = 7 * 86400


def parse_env(items: list[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` items as a mapping."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecError("--env", item, "KEY=VALUE")
        env[key] = value
    return env


def _job_id(name: str, value: Any) -> str:  # the rendezvous id, a Slurm job name, part of file names
    return grammar.check(name, value, grammar.NAME, "letters, digits and _ . + - (1-128)")


#: the placement's options (:class:`~dtrain.launch.backends.placement.Placement`), declared with it and
#: checked by the registry when one is resolved
PLACEMENT_OPTIONS = PLACEMENT_TABLE.names

JOB_OPTIONS = Options([
    PLACEMENT_TABLE["nodes"],
    PLACEMENT_TABLE["procs_per_node"],
    Option("distribution", str, "pytorch", templated=True, choices=DISTRIBUTIONS),
    PLACEMENT_TABLE["backend"],
    Option("deepspeed_config", str | dict, None, "DeepSpeed JSON config (validated before launch)", templated=True,
           cli={"metavar": "FILE"}),
    Option("model_parallel_size", int, 1, "distribution deepspeed: tensor-parallel size the script uses (DeepSpeed's "
                                          "batch arithmetic counts data-parallel ranks: world size / (model x pipeline "
                                          "parallel))", templated=True, check=integer(1, 4096)),
    Option("pipeline_parallel_size", int, 1, "distribution deepspeed: pipeline stages the script uses", templated=True,
           check=integer(1, 4096)),
    Option("pass_local_rank", bool, False, "append --local_rank=N to every rank's command, as the deepspeed launcher "
                                           "does", check=boolean, cli={"action": "store_true"}),
    Option("max_restarts", int, 0, "torchrun worker restarts after a failure", templated=True, check=integer(0, 100)),
    Option("hang_timeout", float, None, "declare the job hung when a rank shows no progress (a printed line, a metrics "
                                        "record, a heartbeat) for SECONDS: dump every rank's stack, stop the job, exit "
                                        "124 (default: off)", templated=True, check=number(1, WEEK_S),
           cli={"metavar": "SECONDS"}, operator_default=OPERATOR_HANG_TIMEOUT),
    Option("stop_grace", float, 30.0, "on a stop (SIGTERM, a preemption), seconds every rank has to save a checkpoint "
                                      "and exit before it is killed (default 30)", check=number(0, 3600),
           cli={"metavar": "SECONDS"}),
    Option("rdzv_port", int, 0, "rendezvous port (default: a free port per job)", check=integer(0, 65535),
           operator=False),
    # torchrun takes whole seconds: below 1 it would be 0 and fail late in the rendezvous.
    Option("rdzv_timeout", float, 300.0, "seconds for all nodes to join", check=number(1, WEEK_S)),
    PLACEMENT_TABLE["device"],
    PLACEMENT_TABLE["gpus_per_node"],
    Option("run_dir", str, None, "checkpoints, metrics and exit records (reuse it to resume)", templated=True),
    Option("env", dict, {}, "extra env for every rank", templated=True, check=coerce_env, from_cli=parse_env,
           cli={"action": "append", "default": [], "metavar": "KEY=VALUE"}, operator_default=None),
    Option("mpi_options", list[str], None, "distribution mpi: extra mpirun option(s), repeatable; "
                                           "--mpi-option='-x NCCL_DEBUG=VERSION'", templated=True, flag="--mpi-option",
           cli={"action": "append", "metavar": "OPT", "dest": "mpi_options"}),
    Option("parameter_servers", int, 0, "distribution tensorflow: ranks that are TF_CONFIG 'ps' tasks (legacy TF 1.x)",
           check=integer(minimum=0)),
    PLACEMENT_TABLE["backend_options"],
    Option("workdir", str, None, "working directory of every rank (default: the current directory)",
           flag=None),  # checked by the spec: it must exist
    Option("job_id", str, None, "rendezvous id and run name (default: generated)", check=_job_id, flag=None,
           operator=False),
])
