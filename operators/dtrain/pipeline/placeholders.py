"""``{shards}``, ``{output}``, ``{init_from}``... in a pipeline's training ``command`` and ``heldout``.

The factory replaces each placeholder with the Jinja template that yields its value for the
run, once, when the DAG is built; Airflow renders it when the task runs, so the task's
"Rendered Template" shows the argv the ranks get. Pure: no Airflow import.

Grammar: a placeholder is exactly ``{name}`` or ``{params.NAME}``, with ``name`` one of
:data:`PLACEHOLDERS` and ``NAME`` a param of the pipeline. The launcher's per-rank placeholders
(``{deepspeed_config}``, ``{local_rank}``...: dtrain.launch.node.placeholders) pass through untouched,
for the rank wrapper to fill. Anything else in braces that
looks like one (``{shard}``, ``{params.epoch}``) is refused with the known names, so a typo
fails the DAG at parse time instead of reaching the training script as literal text; other
braces (JSON such as ``{"lr": 1}``) are left alone. Values are never shell-expanded: argv
elements reach the ranks as they are.

One pass: the text is scanned once, here, and a value is never scanned again. The rank wrapper
fills the per-rank placeholders of the rendered argv later, so a param value that goes there
(``x}{run_dir}{rank`` from the UI) has its braces written as the launcher's literal ``{lbrace}``
(:func:`dtrain.launch.node.placeholders.literal`, through the DAG's :data:`LITERAL_MACRO`): the rank
gets the value as it was typed, and nothing in it is filled.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from dtrain.errors import SpecError
from dtrain.launch.node.placeholders import PLACEHOLDERS as PER_RANK
from dtrain.launch.node.placeholders import literal

#: the DAG macro that writes a value for a launch command (the factory registers :func:`literal_text`)
LITERAL_MACRO = "dtrain_literal"
#: the DAG macro that gives the run's params checked and converted (the factory registers
#: :func:`dtrain.pipeline.params.checked_values` on the DAG's schemas)
PARAMS_MACRO = "dtrain_params"
#: the Jinja expression of the run's checked params: read from the run's params (fixed when the run
#: is triggered), never from check_params' XCom (which the REST API lets its editors change)
RUN_PARAMS = f"{PARAMS_MACRO}(params)"

#: what each placeholder means (the README's table is generated from the same text in tests)
PLACEHOLDERS: dict[str, str] = {
    "shards": "the staged dataset directory on the shared filesystem (what every node reads)",
    "output": "where rank 0 must write the trained model (a file or a directory) inside the run directory",
    "init_from": "the last model published before this run's partition, or '' when there is none (warm start)",
    "run_dir": "the run directory (checkpoints, metrics, logs); a retry reuses it, a cleared run gets a new one",
    "checkpoint_dir": "run_dir/checkpoints, where dtrain.training.CheckpointManager saves by default",
    "version": "the run's dataset_version param",
    "partition": "the run's data-interval partition (YYYY-MM-DD of its logical date)",
    "heldout": "the held-out data location given to the factory, with its own placeholders filled",
}
#: what can appear in braces and be meant as a placeholder: a name, or params.NAME
LOOKS_LIKE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\}")


def literal_text(value: object) -> str:
    """A param's value as it renders, for a launch command: the rank wrapper gives it back verbatim."""
    return literal(str(value))


def param_value(name: str) -> str:
    """The Jinja expression of the run's param ``name``, as :data:`RUN_PARAMS` gives it."""
    return f"{RUN_PARAMS}[{name!r}]"


def param_jinja(name: str, for_ranks: bool = False) -> str:
    """The template rendering the run's param ``name`` (built-in or the pipeline's own): one path
    for every param a task gets. ``for_ranks``: written with :data:`LITERAL_MACRO` (see :func:`to_jinja`)."""
    value = param_value(name)
    return "{{ " + (f"{LITERAL_MACRO}({value})" if for_ranks else value) + " }}"


def to_jinja(text: str, field: str, templates: Mapping[str, str], params: Iterable[str],
             for_ranks: bool = False) -> str:
    """``text`` with each placeholder replaced by its Jinja template.

    ``templates``: placeholder name -> Jinja text giving its value, for the names valid in
    this field; ``params``: the pipeline's param names (``{params.NAME}``: :func:`param_jinja`, the
    run's value as ``check_params`` converts it, so ``2.0`` arrives as ``2``). ``for_ranks``: the text is part of a
    launch command, whose per-rank placeholders the rank wrapper fills: param values are written
    with :data:`LITERAL_MACRO` so that it never fills anything inside them.
    """
    if not isinstance(text, str):
        raise SpecError(field, text, "text")
    param_names = set(params)

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name.startswith("params."):
            param = name.split(".", 1)[1]
            if param in param_names:
                return param_jinja(param, for_ranks)
            raise SpecError(field, text, f"{{params.NAME}} with NAME a param of this pipeline "
                                         f"({', '.join(sorted(param_names)) or 'none'}); {match.group(0)} is not")
        if name in templates:
            return templates[name]
        if name in PER_RANK:
            return match.group(0)
        raise SpecError(field, text, f"placeholders {', '.join('{' + n + '}' for n in templates)}, "
                                     f"{{params.NAME}} or the launcher's per-rank ones; {match.group(0)} is not one")

    return LOOKS_LIKE.sub(replace, text)
