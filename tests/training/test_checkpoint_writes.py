"""How the torch-format checkpoint lands on disk (real torch.save, real files): one fsync per file
(the checkpoint and the ``latest`` pointer) and none of the folder, as the training loop waits on it;
no temporary file left; a link planted at ``latest`` is replaced, never written through."""

from __future__ import annotations

import os

import pytest

from tests.support import record_fsyncs

torch = pytest.importorskip("torch")

from dtrain.training import CheckpointManager  # noqa: E402


def test_a_save_fsyncs_each_file_once_and_not_the_folder(tmp_path, monkeypatch):
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), every_n_steps=1)
    synced = record_fsyncs(monkeypatch)
    ckpt.save(1, {"w": torch.ones(4)})
    assert synced == ["file", "file"]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step-00000001.pt"]


def test_a_link_planted_at_latest_is_replaced_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "latest").symlink_to(victim)
    ckpt = CheckpointManager(str(folder), every_n_steps=1)
    ckpt.save(2, {"w": torch.zeros(2)})
    assert victim.read_text() == "precious"
    assert not (folder / "latest").is_symlink() and (folder / "latest").read_text() == "step-00000002.pt\n"
    assert torch.load(ckpt.latest_path(), weights_only=True)["step"] == 2
