"""The backend registry: the one place that maps a backend name to its class.

Built-in backends are listed here by import path (imported on first use, so a DAG that
never launches on Slurm never imports it); third-party backends register through the
``dtrain.backends`` entry-point group, so a ``pip install`` of a package declaring::

    [options.entry_points]
    dtrain.backends =
        k8s = mypkg.dtrain_k8s:KubernetesBackend

makes ``backend="k8s"`` valid in the spec, the operator and ``dtrain launch`` without
touching this package. Code outside ``backends/<name>/`` reaches a backend only through
:func:`get_backend_class` / :func:`backend_for` and the :class:`Backend` contract.

The registry also resolves a :class:`Placement` (:func:`resolve_placement`, an operator's:
:func:`operator_placement`): it checks every field against the named backend's class and keeps what
that backend resolved from its options.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dtrain import grammar
from dtrain.args import coerce_int, mapping_arg, node_range
from dtrain.errors import DTrainError, SpecError
from dtrain.launch.backends.base import Backend, BackendOutcome, DryRunRequest, JobHandle, JobStatus
from dtrain.launch.backends.placement import PLACEMENT_TABLE, Placement

if TYPE_CHECKING:
    from dtrain.launch.core.spec import LaunchSpec

__all__ = ["Backend", "BackendOutcome", "DryRunRequest", "JobHandle", "JobStatus", "ENTRY_POINT_GROUP", "Placement",
           "backend_names", "get_backend_class", "backend_for", "runner_for", "register_backend", "reload_entry_points",
           "resolve_placement", "operator_placement"]

ENTRY_POINT_GROUP = "dtrain.backends"
BUILTIN: dict[str, str] = {
    "local": "dtrain.launch.backends.local:LocalBackend",
    "ssh": "dtrain.launch.backends.ssh:SSHBackend",
    "slurm": "dtrain.launch.backends.slurm:SlurmBackend",
    "mpi": "dtrain.launch.backends.mpi:MPIBackend",
}
_registered: dict[str, str | type[Backend]] = {}


@functools.lru_cache(maxsize=1)
def _entry_points() -> dict:
    if not _group_may_be_declared():
        return {}
    import importlib.metadata  # here: a launch of a built-in backend need not pay for it

    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _group_may_be_declared() -> bool:
    """Whether a distribution on ``sys.path`` may declare :data:`ENTRY_POINT_GROUP`: a plain read of
    every ``*.dist-info``/``*.egg-info`` ``entry_points.txt``. ``importlib.metadata.entry_points``
    parses every installed distribution's metadata first (with Airflow's hundreds, a large share of
    ``dtrain launch``'s start: CHANGELOG.md), so it runs only when one names the group. A path entry
    this cannot list the same way (a zip, an egg) counts as maybe."""
    needle = f"[{ENTRY_POINT_GROUP}]"
    for entry in sys.path:
        entry = entry or "."
        if os.path.isfile(entry):
            return True
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        for name in names:
            if name.endswith(".egg"):
                return True
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            try:
                with open(os.path.join(entry, name, "entry_points.txt"), encoding="utf-8", errors="replace") as fh:
                    if needle in fh.read(1 << 20):
                        return True
            except OSError:
                continue
    return False


def reload_entry_points() -> None:
    """Forget the entry points read so far (after installing a backend package in this process)."""
    importlib.invalidate_caches()
    _entry_points.cache_clear()


def register_backend(name: str, target: str | type[Backend]) -> None:
    """Register a backend in this process: a class, or ``"module:Class"`` imported on first use."""
    _registered[name] = target


def backend_names() -> tuple[str, ...]:
    """Every backend name known now: built-in, registered, and from installed entry points."""
    return tuple(dict.fromkeys([*BUILTIN, *_registered, *sorted(_entry_points())]))


def _load(name: str, target) -> type[Backend]:
    """``target``: a class, an entry point (stdlib's or the importlib_metadata backport's, which
    Airflow may have loaded: both have ``load``), or ``"module:Class"``."""
    if isinstance(target, type):
        cls = target
    elif hasattr(target, "load"):
        cls = target.load()
    else:
        module_name, _, attr = target.partition(":")
        cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise DTrainError(f"backend {name!r} ({target}) is not a dtrain.launch.backends.Backend subclass")
    if cls.name != name:
        raise DTrainError(f"backend {name!r} ({target}) declares name={cls.name!r}: register it under that name")
    return cls


def get_backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``; SpecError (exit 2) naming the known ones when unknown."""
    target = _registered.get(name) or BUILTIN.get(name)
    if target is None:
        target = _entry_points().get(name)
    if target is None:
        raise SpecError("backend", name, f"one of {', '.join(backend_names())} (installed backends)")
    try:
        return _cached_load(name, target)
    except ImportError as e:
        raise DTrainError(f"backend {name!r} could not be imported ({e})") from e


@functools.lru_cache(maxsize=None)
def _cached_load(name: str, target) -> type[Backend]:
    return _load(name, target)


def runner_for(backend: str, distribution: str) -> type[Backend]:
    """The backend class that runs a job of ``distribution`` placed on ``backend`` (the named one,
    or the one it hands the distribution to)."""
    cls = get_backend_class(backend)
    runner = cls.runner(distribution)
    return cls if runner == cls.name else get_backend_class(runner)


def backend_for(spec: "LaunchSpec") -> type[Backend]:
    """The backend class that runs ``spec``."""
    return runner_for(spec.placement.backend, spec.distribution)


def _names_with(flag: str) -> list[str]:
    out = []
    for name in backend_names():
        try:
            if getattr(get_backend_class(name), flag):
                out.append(name)
        except DTrainError:
            continue
    return out


def detachable_backend_names() -> list[str]:
    """Names of the backends whose jobs can outlive the submitting process (deferrable mode)."""
    return _names_with("supports_detached")


def elastic_backends() -> list[str]:
    """Names of the backends that run elastic jobs (``nodes="MIN:MAX"``)."""
    return _names_with("supports_elastic")


def options_for(name: str, backend_options: object) -> dict:
    """The chosen backend's section of an operator's ``backend_options`` (``{backend name: options}``),
    completed at execute time by the backend (e.g. from an Airflow connection).

    Sections for other registered backends are allowed (a DAG whose UI param picks the backend
    sets them all); a key that names no installed backend is refused as the typo it is.
    """
    sections = mapping_arg("backend_options", backend_options, not_json="a mapping (or a JSON object string)",
                           not_mapping="a mapping of backend name to that backend's options")
    known = backend_names()
    checked: dict[str, dict] = {}
    for key, value in sections.items():
        if key not in known:
            raise SpecError("backend_options", key, f"keys are backend names: {', '.join(known)}")
        checked[key] = dict(mapping_arg(f"backend_options[{key!r}]", value,
                                        not_json="a mapping (or a JSON object string)",
                                        not_mapping="a mapping of that backend's options"))
    return get_backend_class(name).resolve_operator_options(checked.get(name, {}))


# -- placements --------------------------------------------------------------------------------------

def resolve_placement(*, nodes: Any = 1, procs_per_node: Any = 1, backend: Any = "local", backend_options: Any = None,
                      device: Any = "auto", gpus_per_node: Any = None, min_nodes: Any = None) -> Placement:
    """A :class:`Placement`, checked against backend ``backend``'s class (a :class:`SpecError` naming the
    field, the value and what is allowed), with what that backend resolved from ``backend_options``.

    ``nodes``: a count, or ``"MIN:MAX"`` for an elastic job (also given as ``min_nodes`` and ``nodes``;
    MIN equal to MAX is a fixed count) on a backend with ``supports_elastic``. Values may be text
    (rendered templates, UI params); they are converted here.
    """
    name = str(backend).strip().lower()
    backend_cls = get_backend_class(name)  # SpecError naming the installed ones
    least, most = node_range("nodes", nodes, maximum=grammar.MAX_NODES)
    if min_nodes is not None:
        if least != most:
            raise SpecError("nodes", nodes, "MIN:MAX or min_nodes, not both")
        least = coerce_int("min_nodes", min_nodes, minimum=1, maximum=most)
    least = None if least == most else least
    if least is not None and not backend_cls.supports_elastic:
        raise SpecError("nodes", f"{least}:{most}", f"a fixed count on backend {name!r} (elastic jobs: "
                                                    f"{', '.join(elastic_backends())})")
    placement = Placement(
        nodes=most, min_nodes=least, backend=name,
        procs_per_node=PLACEMENT_TABLE.check("procs_per_node", procs_per_node),
        options=dict(mapping_arg("backend_options", backend_options,
                                 not_json="a mapping (or a JSON object string)",
                                 not_mapping="a mapping of the backend's options")),
        device=PLACEMENT_TABLE.check("device", device),
        gpus_per_node=PLACEMENT_TABLE.check("gpus_per_node", gpus_per_node))
    _check_gpus(placement, backend_cls.single_host)
    return replace(placement, resolved=backend_cls.resolve_placement(placement))


def operator_placement(*, nodes: Any, procs_per_node: Any, backend: Any, backend_options: Any,
                       device: Any = "auto", gpus_per_node: Any = None) -> Placement:
    """An operator's placement: ``backend_options`` is ``{backend name: options}``; the chosen
    backend's section is completed where the task runs (e.g. from an Airflow connection)."""
    name = str(backend).strip().lower()
    return resolve_placement(nodes=nodes, procs_per_node=procs_per_node, backend=name,
                             backend_options=options_for(name, backend_options), device=device,
                             gpus_per_node=gpus_per_node)


def _check_gpus(placement: Placement, on_this_host: bool) -> None:
    # This host's GPUs say nothing about remote nodes: count them only for a backend
    # running here, unless the user stated gpus_per_node.
    if not on_this_host and placement.gpus_per_node is None:
        return
    capacity = placement.gpu_capacity()
    if placement.device == "gpu" and capacity == 0:
        raise SpecError("device", "gpu", "a host with at least one visible GPU (none found)")
    if capacity > 0 and placement.device != "cpu" and placement.procs_per_node > capacity:
        raise SpecError(
            "procs_per_node",
            placement.procs_per_node,
            f"at most the {capacity} GPU(s) per node on this host (use device='cpu' to run on CPU)",
        )
