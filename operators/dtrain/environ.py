"""This process's environment, changed for a while: credentials that a client library reads from it."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping


@contextlib.contextmanager
def temporarily(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in os.environ, and restore what was there (or its absence) afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
