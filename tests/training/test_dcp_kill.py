"""Complete or invisible: a real 2-rank gloo job saving DCP checkpoints is killed at each phase of a
save (one rank before its shards are written, every rank after the shards and .metadata but before
the commit marker, every rank while the asynchronous upload runs). The checkpoint before it stays
the latest and loads whole (compared tensor by tensor with what the job saved); a resume replaces
the cut-short folder.
"""

from __future__ import annotations

import pytest

from tests.support import poll_until, wait_for
from tests.training.dcp_checks import assert_same_state

pytestmark = pytest.mark.timeout(300)

#: phase -> (ranks that pause, ranks killed: () = all, files of step 4 that must exist, files that must not)
PHASES = {
    "write": ((1,), (1,), ["__0_0.distcp"], [".metadata", "dtrain-commit.json"]),
    "commit": ((0,), (), ["__0_0.distcp", "__1_0.distcp", ".metadata"], ["dtrain-commit.json"]),
    "async": ((0, 1), (), [], [".metadata", "dtrain-commit.json"]),
}


def load_at_world_one(location):
    """The latest complete checkpoint, loaded in this process (world size 1: resharded from 2)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dtrain.training.ckpt_storage import open_storage
    from dtrain.rundir import DCP_FOLDER as FOLDER
    from dtrain.training.dcp import DcpCheckpointer, ModelState
    from tests.training.scripts.dcp_job import build_model

    model, _ = build_model("plain")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    found = DcpCheckpointer(open_storage(f"{location}/{FOLDER}")).load({"app": ModelState(model, optimizer)})
    m, o = get_state_dict(model, optimizer)
    return found, {"model": m, "optimizer": o}


@pytest.mark.parametrize("phase", list(PHASES))
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_latest(jobs, tmp_path, phase):
    pausing, victims, present, absent = PHASES[phase]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    args = ["--dir", ckpt, "--out", out, "--model", "ddp", "--steps", 8, "--every", 2,
            "--hang", phase, "--hang-step", 4, *(["--async-save"] if phase == "async" else [])]
    job = jobs("dcp_job.py", args, 2)
    wait_for(lambda: all((out / f"ready.{r}").exists() for r in pausing) or
             any(p.poll() is not None for p in job.procs), timeout=120, what=f"the save paused at {phase}")
    assert all(p.poll() is None for p in job.procs), job.logs()
    if phase == "async":  # the save is in flight in the background and training went on past it
        wait_for(lambda: '"step": 5' in (out / "samples.rank0.jsonl").read_text(), timeout=60,
                 what="a training step after the asynchronous save returned")
    job.kill(*victims)
    if victims:  # the survivors notice the dead peer (gloo) and fail on their own
        assert poll_until(lambda: all(p.poll() is not None for p in job.procs), timeout=60), job.logs()
        assert all(p.returncode != 0 for p in job.procs)
    job.kill()

    cut = ckpt / "dcp" / "step-00000004"
    for name in present:
        assert (cut / name).exists(), (phase, name)
    for name in absent:
        assert not (cut / name).exists(), (phase, name)
    found, state = load_at_world_one(str(ckpt))
    assert found.step == 2
    assert_same_state(out / "ref-2.pt", state)

    if phase == "commit":  # the retry: resumes from step 2 and saves step 4 over the cut-short folder
        resumed = jobs("dcp_job.py", ["--dir", ckpt, "--out", out, "--model", "ddp", "--steps", 4, "--every", 2], 2)
        assert resumed.wait() == [0, 0], resumed.logs()
        assert_same_state(out / "ref-2.pt", out / "loaded-2.pt")
        found, state = load_at_world_one(str(ckpt))
        assert found.step == 4
        assert_same_state(out / "ref-4.pt", state)
