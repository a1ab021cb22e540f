"""A registry artifact lies beside the model the ranks wrote: copying it into the MLflow Model follows
no link, in the artifact's path or inside an artifact folder."""

from __future__ import annotations

import os

import pytest

from dtrain.pipeline.publish import PublishError
from dtrain.mlflow.registry import _artifact_source, _copy_artifact


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "output"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"weights")
    (folder / "tokenizer.json").write_text('{"vocab": 1}')
    (tmp_path / "secret").write_text("worker's file")
    return folder


def test_a_regular_file_is_copied(model_dir, tmp_path):
    source = _artifact_source(str(model_dir / "model.pt"), "tokenizer.json")
    _copy_artifact("tokenizer", source, str(tmp_path / "mlflow-model" / "artifacts" / "tokenizer"))
    assert (tmp_path / "mlflow-model" / "artifacts" / "tokenizer").read_text() == '{"vocab": 1}'


def test_a_link_in_place_of_the_file_is_refused_not_followed(model_dir, tmp_path):
    (model_dir / "tokenizer.json").unlink()
    os.symlink(tmp_path / "secret", model_dir / "tokenizer.json")
    with pytest.raises(PublishError, match="symbolic link"):
        _artifact_source(str(model_dir / "model.pt"), "tokenizer.json")
    # the copy checks again (a link swapped in after the path was checked)
    with pytest.raises(PublishError, match="symbolic link"):
        _copy_artifact("tokenizer", str(model_dir / "tokenizer.json"), str(tmp_path / "out" / "tokenizer"))
    assert not (tmp_path / "out" / "tokenizer").exists()


def test_a_fifo_in_place_of_the_file_is_refused(model_dir, tmp_path):
    (model_dir / "tokenizer.json").unlink()
    os.mkfifo(model_dir / "tokenizer.json")
    with pytest.raises(PublishError, match="not a regular file"):
        _copy_artifact("tokenizer", str(model_dir / "tokenizer.json"), str(tmp_path / "out" / "tokenizer"))


def test_a_folder_holding_a_link_is_refused(model_dir, tmp_path):
    (model_dir / "vocab").mkdir()
    os.symlink(tmp_path / "secret", model_dir / "vocab" / "merges.txt")
    with pytest.raises(PublishError, match="symbolic link"):
        _copy_artifact("vocab", str(model_dir / "vocab"), str(tmp_path / "out" / "vocab"))
