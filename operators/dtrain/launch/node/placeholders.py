"""Per-rank placeholders in a launch ``command``: ``{deepspeed_config}``, ``{local_rank}``, ...

The rank wrapper (dtrain.launch.node.rank_entry) replaces each one with this rank's literal value
just before it starts the command, so a DeepSpeed script can take
``--deepspeed_config {deepspeed_config}`` without the config being given twice. There is no
shell and no other expansion: only exactly ``{name}`` with ``name`` below is replaced (inside an
argument too: ``--local_rank={local_rank}``); any other brace, ``$VAR`` or ``~`` reaches the
script as written, and a replaced value is never scanned again. ``{lbrace}`` is a literal ``{``:
what a value filled in before the ranks start (a pipeline's ``{params.NAME}``) writes its braces
as (:func:`literal`), so that nothing in it is taken for a placeholder here. Stdlib only.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

#: placeholder -> (the environment variable of the rank that holds its value, what it is)
PLACEHOLDERS: dict[str, tuple[str, str]] = {
    "deepspeed_config": ("DTRAIN_DEEPSPEED_CONFIG", "the validated DeepSpeed config file (distribution deepspeed)"),
    "run_dir": ("DTRAIN_RUN_DIR", "the job's run directory"),
    "checkpoint_dir": ("DTRAIN_CHECKPOINT_DIR", "run_dir/checkpoints"),
    "metrics_dir": ("DTRAIN_METRICS_DIR", "run_dir/metrics"),
    "local_rank": ("LOCAL_RANK", "this rank's index on its node"),
    "rank": ("RANK", "this rank's global index"),
    "node_rank": ("NODE_RANK", "this rank's node index"),
    "world_size": ("WORLD_SIZE", "the number of ranks"),
    "local_world_size": ("LOCAL_WORLD_SIZE", "ranks on this node"),
}
#: ``{lbrace}``: a literal ``{`` (see the module docstring)
LBRACE = "lbrace"
PATTERN = re.compile(r"\{(" + "|".join([*PLACEHOLDERS, LBRACE]) + r")\}")


def used(command: Sequence[str]) -> set[str]:
    """The placeholders ``command`` uses."""
    return {m.group(1) for arg in command for m in PATTERN.finditer(arg)} - {LBRACE}


def literal(value: str) -> str:
    """``value`` as command text that :func:`fill` turns back into exactly ``value``, in the same
    single pass that fills the placeholders around it."""
    return value.replace("{", "{" + LBRACE + "}")


def fill(command: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """``command`` with every placeholder replaced by its value in ``environ`` (left as written if unset)."""
    def value(match: re.Match) -> str:
        name = match.group(1)
        return "{" if name == LBRACE else environ.get(PLACEHOLDERS[name][0], match.group(0))

    return [PATTERN.sub(value, arg) for arg in command]
