"""docs/training.md is the training API's one page: its script runs as printed, and every public
name (with each public method) is there with its current signature."""

from __future__ import annotations

import enum
import inspect
import json
import os
import re
import subprocess
import sys

import pytest

import dtrain.training
from dtrain.training import loop, shards
from tests.conftest import REPO

PAGE = os.path.join(REPO, "docs", "training.md")
DTRAIN = os.path.join(os.path.dirname(sys.executable), "dtrain")
#: public names outside the package's __all__ that the page documents
MODULE_NAMES = [(shards, "ShardDataset"), (shards, "ShardSampler"), (shards, "ShardLoader")]


def page() -> str:
    with open(PAGE, encoding="utf-8") as fh:
        return fh.read()


def the_script() -> str:
    section = page().split("## A complete script", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _default(value) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__module__.split('.')[0]}.{value.name}"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_default, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def written(name: str, obj) -> str:
    """``name(params)`` as the page writes it: no annotations, ``*`` before keyword-only parameters."""
    parts, star = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.VAR_POSITIONAL:
            parts.append("*" + p.name)
            star = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append("**" + p.name)
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={_default(p.default)}")
    return f"{name}({', '.join(parts)})"


def documented() -> list[tuple[str, object]]:
    names = [(n, getattr(dtrain.training, n)) for n in dtrain.training.__all__]
    names += [(n, getattr(module, n)) for module, n in MODULE_NAMES]
    names.append(("script_args", loop.script_args))
    return names


def test_exit_now_is_exported():
    from dtrain.training import exit_now
    from dtrain.training.dist import exit_now as defined

    assert exit_now is defined and "exit_now" in dtrain.training.__all__


@pytest.mark.parametrize("name, obj", documented(), ids=[n for n, _ in documented()])
def test_every_public_name_is_on_the_page_with_its_signature(name, obj):
    text = page()
    if not callable(obj):
        assert f"### `{name}`" in text and str(obj) in text
        return
    assert f"`{written(name, obj)}" in text, written(name, obj)
    if not inspect.isclass(obj):
        return
    for member, value in inspect.getmembers(obj):
        if member.startswith("_"):
            continue
        if isinstance(inspect.getattr_static(obj, member), property):
            assert f"`.{member}` (property)" in text, f"{name}.{member}"
        elif callable(value) and not isinstance(value, type):
            assert f"`.{written(member, value)}`" in text, f"{name}.{written(member, value)}"


def test_the_page_script_is_short_and_complete():
    script = the_script()
    assert len(script.splitlines()) < 40
    for name in ("CheckpointManager", "MetricsWriter", "write_result", "exit_now", "PreemptionGuard"):
        assert name in script, name


def launch(run_dir: str, script: str, steps: int) -> subprocess.CompletedProcess:
    argv = [DTRAIN, "launch", "--nodes", "1", "--procs-per-node", "2", "--run-dir", run_dir, "--",
            "python", script, str(steps)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240)


def test_the_page_script_trains_checkpoints_and_resumes_under_the_launcher(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(the_script())
    run_dir = str(tmp_path / "run")
    first = launch(run_dir, str(script), 100)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics", "result.json")) as fh:
        assert json.load(fh)["steps"] == 100
    second = launch(run_dir, str(script), 200)  # the same run directory: a retry that asks for more steps
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics", "result.json")) as fh:
        result = json.load(fh)
    assert (result["steps"], result["resumed_from"], result["world_size"]) == (200, 100, 2)
    assert result["mse"] < 1e-3  # y = x.w + 1 is learned
    for rank in (0, 1):
        with open(os.path.join(run_dir, "metrics", f"rank{rank}.jsonl")) as fh:
            steps = [json.loads(line)["step"] for line in fh]
        assert steps == list(range(1, 201)), rank  # 1..100, then 101..200 after the resume
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["latest", "step-00000180.pt",
                                                                         "step-00000200.pt"]
