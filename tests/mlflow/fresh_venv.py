"""A fresh virtual environment holding only what a registered model's requirements list: made with uv
from the same indexes pip is configured with (pip.conf, PIP_*), so nothing of the test venv leaks in."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.airflow_services import BIN

UV = os.path.join(BIN, "uv")
#: pip's settings that say where packages come from, as uv's options (scripts/bootstrap.sh does the same)
PIP_TO_UV = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
             "constraint": "--constraint"}


def uv_options_from_pip() -> list[str]:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            timeout=60).stdout
    options = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        flag = PIP_TO_UV.get(key.rsplit(".", 1)[-1])
        for item in value.strip("'").split() if flag else ():
            options += [flag, item]
    return options


def fresh_venv(path: str, requirements_txt: str) -> str:
    """``path`` made a venv without the system's or this venv's packages, with ``requirements_txt``
    installed; returns its python."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([UV, "venv", "-q", "--python", base, path], check=True, timeout=300)
    python = os.path.join(path, "bin", "python")
    subprocess.run([UV, "pip", "install", "-q", "--python", python, "--index-strategy", "unsafe-best-match",
                    *uv_options_from_pip(), "-r", requirements_txt], check=True, timeout=600)
    return python
