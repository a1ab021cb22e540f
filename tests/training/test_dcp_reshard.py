"""Resharding on resume, with real DCP over gloo: an FSDP2 job saved at world size 4 resumes at 2,
and that one's checkpoint resumes at 4 again. Model and optimizer state are compared tensor by
tensor with what was saved, and the data position with the samples every rank trained: each
sample of the epoch exactly once across the three jobs (DistributedSampler under ResumableSampler).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.training.dcp_checks import assert_same_state
from tests.training.scripts.dcp_job import SAMPLES

pytestmark = pytest.mark.timeout(300)


def trained(out, world: int) -> list[tuple[int, int, list[int]]]:
    rows = []
    for rank in range(world):
        for line in (out / f"samples.rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            rows.append((record["step"], record["epoch"], record["indices"]))
    return rows


def test_fsdp2_checkpoint_saved_at_4_resumes_at_2_and_back_at_4(jobs, tmp_path):
    ckpt = tmp_path / "ckpt"
    outs = [tmp_path / f"out{i}" for i in range(3)]
    for out in outs:
        out.mkdir()
    # 4 ranks x 2 samples: 8 per step; 5 steps consume 40 of the epoch's 96.
    common = ["--dir", ckpt, "--model", "fsdp", "--every", "5", "--batch", "2"]
    first = jobs("dcp_job.py", [*common, "--out", outs[0], "--steps", 5], 4)
    assert first.wait() == [0] * 4, first.logs()
    # 2 ranks: 4 per step; steps 6..11 consume 24 more (64). Its load goes through the host buffers (as
    # CUDA tensors do) and its saves are asynchronous: FSDP2's DTensors staged and restored both ways.
    second = jobs("dcp_job.py", [*common, "--out", outs[1], "--steps", 11, "--async-save", "--through-host"], 2)
    assert second.wait() == [0] * 2, second.logs()
    # 4 ranks again: steps 12..15 consume the last 32 of epoch 0, then 2 steps of epoch 1.
    third = jobs("dcp_job.py", [*common, "--out", outs[2], "--steps", 17], 4)
    assert third.wait() == [0] * 4, third.logs()

    assert_same_state(outs[0] / "ref-5.pt", outs[1] / "loaded-5.pt")      # 4 -> 2
    assert_same_state(outs[1] / "ref-11.pt", outs[2] / "loaded-11.pt")    # 2 -> 4

    rows = trained(outs[0], 4) + trained(outs[1], 2) + trained(outs[2], 4)
    assert sorted({step for step, _, _ in rows}) == list(range(1, 18))
    epoch0 = Counter(i for _, epoch, batch in rows if epoch == 0 for i in batch)
    assert epoch0 == Counter(range(SAMPLES)), "epoch 0: a sample trained twice or skipped across the resumes"
    assert sum(len(batch) for _, epoch, batch in rows if epoch == 1) == 2 * 8
