"""Per-rank placeholders in a launch ``command``: ``{deepspeed_config}``, ``{local_rank}``, ...

The rank wrapper (dtrain.launch.rank_entry) replaces each one with this rank's literal value
just before it starts the command, so a DeepSpeed script can take
``--deepspeed_config {deepspeed_config}`` without the config being given twice. There is no
shell and no other expansion: only exactly ``{name}`` with ``name`` below is replaced (inside an
argument too: ``--local_rank={local_rank}``); any other brace, ``$VAR`` or ``~`` reaches the
script as written, and a replaced value is never scanned again. Stdlib only.
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
PATTERN = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


def used(command: Sequence[str]) -> set[str]:
    """The placeholders ``command`` uses."""
    return {m.group(1) for arg in command for m in PATTERN.finditer(arg)}


def fill(command: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """``command`` with every placeholder replaced by its value in ``environ`` (left as written if unset)."""
    return [PATTERN.sub(lambda m: environ.get(PLACEHOLDERS[m.group(1)][0], m.group(0)), arg) for arg in command]
