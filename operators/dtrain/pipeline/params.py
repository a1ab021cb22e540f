"""The retraining DAG's UI parameters: schema pieces the trigger form and the REST API enforce,
and the checks the run's first task (``check_params``) does before any data is touched.

Airflow validates a triggered run's params against each Param's JSON schema (jsonschema,
server side: a 400 and no run on failure). Two gaps in plain JSON schema are closed here:

* NaN passes every comparison keyword (``minimum``, ``maximum``, ``exclusiveMinimum``: each
  comparison with NaN is False), and Python's ``json`` (so the REST API) accepts a bare ``NaN``.
  :data:`FINITE` refuses it: ``{"maximum": -1e308}`` holds for NaN and -Infinity (and for finite
  numbers at most -1e308, which no param allows), so ``not`` of it refuses them; +Infinity is
  above every param's finite ``maximum``.
* ``$`` matches before a final newline in Python's ``re`` (jsonschema uses ``re.search``), so
  ``^...$`` lets ``"v1\\n"`` through. :data:`END` anchors the end instead: ``(?![\\s\\S])``
  (nothing follows) means the same in Python and in JavaScript (the UI), where ``\\Z`` does not;
  the class's ``-`` is escaped so the pattern also compiles with JavaScript's ``v`` flag (what an
  HTML ``pattern`` attribute uses; the UI's JSON editor compiles with ``u``, else no flag).

What a schema cannot express (conversion of ``2.0`` to ``2``, unknown keys, limits of the worker
the ranks would run on) is :func:`check_params`'s job. Imports nothing heavy (no Airflow either).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Mapping

from dtrain import grammar
from dtrain.args import coerce_int, node_range
from dtrain.errors import SpecError

#: end of text in Python and JavaScript regular expressions alike (``$`` also matches before "\n")
END = r"(?![\s\S])"
DATASET_VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}" + END
#: merge into every number Param: refuses NaN and -Infinity (see the module docstring)
FINITE: dict[str, Any] = {"not": {"maximum": -1e308, "description": "NaN or -Infinity (a finite number is required)"}}

MAX_RANKS_ENV = "DTRAIN_LOCAL_MAX_RANKS"
#: ranks per CPU core (or GPU) that backend=local may start. The demo's 2 nodes x 2 processes must
#: run on a 2-core worker, and gloo-on-CPU ranks spend much of each step waiting on the
#: all-reduce, so a few per core still progress; far beyond that, time-slicing stretches every
#: collective towards its timeout and each rank's own interpreter + torch (hundreds of MB)
#: exhausts the worker's memory. Override per worker with DTRAIN_LOCAL_MAX_RANKS.
OVERSUBSCRIPTION = 4


class ParamError(SpecError):
    """A DAG run parameter is invalid: names the param, the value given and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str, message: str | None = None):
        super().__init__(field, value, allowed)
        self.args = (message or f"param {field}={value!r} is invalid: {allowed}",)

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        return self.__class__, (self.field, self.value, self.allowed, self.args[0])


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_rank_limit(environ: Mapping[str, str] | None = None, *, cpus: int | None = None,
                     gpus: int | None = None) -> tuple[int, str]:
    """The most ranks backend=local may start on this worker, and how that number was found."""
    env = os.environ if environ is None else environ
    configured = env.get(MAX_RANKS_ENV, "").strip()
    if configured:
        try:
            return coerce_int(MAX_RANKS_ENV, configured, minimum=1), f"{MAX_RANKS_ENV}={configured} on this worker"
        except SpecError as e:
            raise SpecError(f"environment variable {MAX_RANKS_ENV}", configured,
                            "a positive integer (the most ranks backend=local may start on this worker)") from e
    if cpus is None:
        cpus = usable_cpus()
    if gpus is None:
        from dtrain.launch.backends.placement import visible_gpu_count

        gpus = visible_gpu_count()
    limit = max(cpus, gpus) * OVERSUBSCRIPTION
    why = f"{OVERSUBSCRIPTION} per CPU core or GPU: {cpus} CPU core(s), {gpus} GPU(s); {MAX_RANKS_ENV} overrides"
    return limit, why


#: the JSON-schema type of a nodes param: a count, or text ("3", or an elastic job's "2:4")
NODES_TYPE = ["integer", "string"]
NODES_PATTERN = r"^\s*\d{1,6}\s*(:\s*\d{1,6}\s*)?$"


def _check_one(name: str, value: Any, schema: Mapping[str, Any]) -> Any:
    kind = schema.get("type")
    if kind == NODES_TYPE:  # a count of nodes, or an elastic job's "MIN:MAX"
        least, most = node_range(name, value, maximum=schema.get("maximum", grammar.MAX_NODES))
        value = most if least == most else f"{least}:{most}"
    elif kind == "integer":
        value = coerce_int(name, value, minimum=schema.get("minimum"), maximum=schema.get("maximum"))
    elif kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -sys.float_info.max))
        high = schema.get("maximum", schema.get("exclusiveMaximum", sys.float_info.max))
        value = grammar.finite(name, value, minimum=low, maximum=high)
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            raise SpecError(name, value, f"a number greater than {schema['exclusiveMinimum']:g}")
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            raise SpecError(name, value, f"a number less than {schema['exclusiveMaximum']:g}")
    elif kind == "string":
        if not isinstance(value, str):
            raise SpecError(name, value, "text")
        if "pattern" in schema and re.fullmatch(schema["pattern"], value) is None:
            raise SpecError(name, value, f"text matching {schema['pattern']} (no trailing newline)")
    if "enum" in schema and value not in schema["enum"]:
        raise SpecError(name, value, f"one of {', '.join(map(str, schema['enum']))}")
    return value


def _on_this_worker(backend: Any) -> bool:
    """Whether the backend starts every rank on this worker (the registry knows; no name is compared)."""
    from dtrain.errors import DTrainError
    from dtrain.launch.backends import get_backend_class

    try:
        return backend is not None and get_backend_class(str(backend)).single_host
    except DTrainError:
        return False  # an unknown backend is refused by the schema or the spec, with its own message


def checked_values(params: Mapping[str, Any], schemas: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The run's params checked against their schemas and converted (``2.0`` -> ``2``): the values
    every task of the pipeline uses. :class:`ParamError` on the first problem.

    ``schemas``: each param's JSON schema (the DAG's Params). Checks, in order: no key the DAG
    does not declare (a typo would be ignored silently); each value against its schema with
    the project's own grammar (integral floats converted, NaN/Infinity refused, patterns
    matched in full). Depends on its arguments only: the same params give the same values on
    every worker (:func:`check_params` adds what depends on the worker).
    """
    unknown = sorted(set(params) - set(schemas))
    if unknown:
        raise ParamError(unknown[0], params[unknown[0]],
                         f"not a parameter of this DAG (it has {', '.join(schemas)})")
    values: dict[str, Any] = {}
    for name, schema in schemas.items():
        try:
            values[name] = _check_one(name, params.get(name), schema)
        except SpecError as e:
            raise ParamError(e.field, e.value, e.allowed) from None
    return values


def check_params(params: Mapping[str, Any], schemas: Mapping[str, Mapping[str, Any]], *,
                 environ: Mapping[str, str] | None = None, cpus: int | None = None,
                 gpus: int | None = None) -> dict[str, Any]:
    """:func:`checked_values`, then what depends on this worker: backend=local starts all
    nodes x procs_per_node ranks here, at most :func:`local_rank_limit`. :class:`ParamError` on
    the first problem."""
    values = checked_values(params, schemas)
    nodes, procs = values.get("nodes"), values.get("procs_per_node")
    if _on_this_worker(values.get("backend")) and nodes is not None and procs is not None:
        nodes = node_range("nodes", nodes, maximum=grammar.MAX_NODES)[1]  # an elastic job's MAX
        limit, why = local_rank_limit(environ, cpus=cpus, gpus=gpus)
        ranks = nodes * procs
        if ranks > limit:
            allowed = f"at most {limit} ranks here ({why})"
            raise ParamError("nodes x procs_per_node", ranks, allowed, message=(
                f"param nodes={nodes} x procs_per_node={procs} = {ranks} ranks is too many for backend=local, "
                f"which starts every rank on this Airflow worker: {allowed}. "
                "Lower nodes or procs_per_node, or choose backend=ssh or slurm."))
    return values


def check_launch(values: Mapping[str, Any], backend_options: Mapping[str, Any],
                 deepspeed_config: str | Mapping[str, Any] | None = None):
    """What preflight and train will refuse about these params, checked here first, so that it fails
    the run before any data is touched: the placement (procs_per_node above this host's GPUs with
    backend=local, fewer ssh hosts than nodes, a bad backend option), the distribution on that
    backend, and the DeepSpeed config against the world size. Raises :class:`SpecError`; returns
    the :class:`~dtrain.launch.backends.placement.Placement`."""
    from dtrain.launch.core.deepspeed_config import resolve_deepspeed_config
    from dtrain.launch.backends import operator_placement
    from dtrain.launch.core.spec import check_distribution

    placement = operator_placement(nodes=values["nodes"], procs_per_node=values["procs_per_node"],
                                   backend=values["backend"], backend_options=backend_options)
    if check_distribution(placement, values["distribution"]) == "deepspeed":
        resolve_deepspeed_config(deepspeed_config or None, placement.world_size, 1, 1)
    return placement
