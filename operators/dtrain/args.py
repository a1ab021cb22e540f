"""Arguments that arrive either as objects or as text.

A templated operator argument or a UI param reaches ``execute`` as a rendered string, and a
DAG author may write the same value as a dict: both must mean the same thing.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from operators.errors import SpecError


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
