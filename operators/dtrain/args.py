"""Arguments that arrive either as objects or as text.

A templated operator argument or a UI param reaches ``execute`` as a rendered string, and a
DAG author may write the same value as a dict: both must mean the same thing.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any, Mapping

from dtrain import grammar
from dtrain.errors import SpecError


def mapping_arg(name: str, value: Any, *, not_json: str, not_mapping: str, secret: bool = False) -> Mapping[str, Any]:
    """``value`` as a mapping: None is empty, a string is parsed as a JSON object ("" is empty).

    Raises SpecError naming ``name`` with ``not_json`` (text that is no JSON) or ``not_mapping``
    (anything else that is no mapping). With ``secret``, the value is never echoed: the error
    shows "<not shown>" or the value's type instead.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as e:
            raise SpecError(name, "<not shown>" if secret else value, not_json) from e
    if not isinstance(value, Mapping):
        raise SpecError(name, type(value).__name__ if secret else value, not_mapping)
    return value


#: a file a user names for a small input (a hostfile, a JSON table, storage options) is at most this big
MAX_INPUT_FILE_BYTES = 1 << 20


def read_input_file(name: str, path: Any, limit: int = MAX_INPUT_FILE_BYTES) -> str:
    """The text of a small input file that the argument ``name`` names, read with a bound.

    Only a regular file of at most ``limit`` bytes of UTF-8 is read: a device (``/dev/zero``,
    ``/dev/urandom``) never ends, a FIFO would block (it is opened without blocking and then
    refused), and a huge file would be read whole. Anything else is a SpecError naming ``name``.
    """
    if not isinstance(path, str) or not path or "\0" in path:
        raise SpecError(name, path, "the path of a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SpecError(name, path, f"a readable file ({e.strerror})") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # checked on the fd: os.fdopen refuses a directory itself
        os.close(fd)
        raise SpecError(name, path, "a regular file (not a device, a FIFO or a directory)")
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise SpecError(name, path, f"a file of at most {limit} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(name, path, "a UTF-8 text file") from e


NODE_RANGE = re.compile(r"\s*(\d{1,6})\s*:\s*(\d{1,6})\s*")


def node_range(name: str, value: Any, *, maximum: int) -> tuple[int, int]:
    """A number of nodes, or an elastic job's ``MIN:MAX`` (text: an operator argument, a UI param, the
    CLI), as (MIN, MAX) with 1 <= MIN <= MAX <= ``maximum``; a count N is (N, N)."""
    if isinstance(value, str) and ":" in value:
        match = NODE_RANGE.fullmatch(value)
        if match is None:
            raise SpecError(name, value, f"a count of nodes (1-{maximum}) or MIN:MAX (an elastic job), e.g. 2:4")
        least, most = int(match.group(1)), int(match.group(2))
        if not 1 <= least <= most <= maximum:
            raise SpecError(name, value, f"MIN:MAX with 1 <= MIN <= MAX <= {maximum} (an elastic job), e.g. 2:4")
        return least, most
    count = coerce_int(name, value, minimum=1, maximum=maximum)
    return count, count


def coerce_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Convert ``value`` (an int, or text from a template) to int, within bounds.

    An integral float, or its text (``2.0``, ``"2.0"``: what a UI param typed as a JSON-schema
    integer can render as), is converted; ``2.5``, NaN and the infinities are refused.
    """
    if isinstance(value, bool):
        raise SpecError(name, value, "an integer is required, not a boolean")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError as e:
                raise SpecError(name, text, "an integer is required") from e
    if isinstance(value, float):
        if not value.is_integer():  # NaN and inf are not integers either
            raise SpecError(name, value, "an integer is required")
        value = int(value)
    if not isinstance(value, int):
        raise SpecError(name, value, "an integer is required")
    if minimum is not None and value < minimum:
        raise SpecError(name, value, f"must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise SpecError(name, value, f"must be at most {maximum}")
    return value


def coerce_float(name: str, value: Any, *, minimum: float = 0.0, maximum: float = 1e9) -> float:
    """A finite number in (minimum, maximum]."""
    number = grammar.finite(name, value, minimum=minimum, maximum=maximum)
    if number <= minimum:
        raise SpecError(name, value, f"must be greater than {minimum:g}")
    return number


def coerce_argv(name: str, value: Any) -> list[str]:
    """An argv list. A string is accepted only as a JSON array (how a rendered list may arrive).

    A plain string is refused rather than split: commands never pass through a shell.
    """
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text) if text.startswith("[") else None
        except json.JSONDecodeError as e:
            raise SpecError(name, text, "a list of strings (argv) is required; a JSON array string is accepted") from e
        if value is None:
            raise SpecError(name, text, "a list of strings (argv) is required, not a shell string")
    if not isinstance(value, (list, tuple)) or not value:
        raise SpecError(name, value, "a non-empty list of strings (argv) is required")
    argv = []
    for item in value:
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            item = str(item)
        if not isinstance(item, str):
            raise SpecError(name, value, "every argv item must be a string")
        argv.append(item)
    return argv


def coerce_env(name: str, value: Any) -> dict[str, str]:
    value = mapping_arg(name, value, not_json="a mapping of strings (or a JSON object string) is required",
                        not_mapping="a mapping of variable name to string is required")
    return {grammar.env_name(f"{name} key", key): grammar.env_value(f"{name}[{key!r}]", item)
            for key, item in value.items()}
