from __future__ import annotations

import os

import pytest

from tests.support import alive, wait_for  # noqa: F401 (re-exported to the tests here)

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def script(name: str) -> str:
    return os.path.join(SCRIPTS, name)


@pytest.fixture
def out_dir(tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    return str(path)
