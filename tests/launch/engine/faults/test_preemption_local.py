"""The preemption tests on the local backend (tests/launch/engine/faults/test_preemption.py says what they check): a module
of their own, so they run beside the ssh and Slurm ones under pytest-xdist."""

from __future__ import annotations

import json

from tests.launch.engine.faults.test_preemption import preempt_and_resume


def test_local_sigterm_between_checkpoints_saves_that_step_and_the_relaunch_resumes_from_it(tmp_path):
    preempt_and_resume(tmp_path, [], nodes=1)


def test_local_deepspeed_sigterm_saves_every_rank_shards_at_that_step_and_the_relaunch_resumes(tmp_path):
    config = tmp_path / "ds.json"  # micro batch 16 x 2 ranks: 44 steps an epoch
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
                                  "zero_optimization": {"stage": 2}, "steps_per_print": 1000}))
    preempt_and_resume(tmp_path, ["--distribution", "deepspeed", "--deepspeed-config", str(config)], nodes=1,
                       epochs=1, deepspeed=True)
