"""A rank plants links in its own run directory (issue 22's HIGH finding): the launcher, the hang
watcher and the next attempt in the same run directory (an Airflow retry) never follow them.

Every case is a real local launch whose rank (tests/launch/scripts/plant.py) plants the links, as
training code on any node sharing the filesystem could; then a second launch in the same run
directory, as a retry does.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from dtrain.launch.core.job import prepare_job
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from dtrain.rundir import RunDir, UnsafeRunDir

from ..conftest import script

PLANT = script("plant.py")


def launch(run_dir, *plants: str, hang_timeout=None, **kwargs):
    spec = LaunchSpec(command=[sys.executable, PLANT, *plants], nodes=1, procs_per_node=1, device="cpu",
                      run_dir=str(run_dir), hang_timeout=hang_timeout, **kwargs)
    lines: list[str] = []
    return Launcher(spec, sink=lines.append).run(), lines


@pytest.fixture
def victim(tmp_path):
    """A directory of someone else's files the rank points its links at."""
    path = tmp_path / "victim"
    path.mkdir()
    (path / "precious.txt").write_text("keep me")
    (path / "secret.json").write_text(json.dumps({"accuracy": 1.0, "aws_secret_access_key": "AKIA-victim"}))
    return path


@pytest.mark.parametrize("owned", ["exits", "hang"])
def test_a_retry_in_the_same_run_directory_does_not_empty_a_linked_directory(tmp_path, victim, owned):
    # Old code: the retry's cleanup listed exits/ (or hang/) through the link and unlinked every
    # file of the victim directory.
    run_dir = tmp_path / "run"
    first, _ = launch(run_dir, f"{owned}={victim}", hang_timeout=30)
    assert first.exit_code == 0 and (run_dir / owned).is_symlink()
    retry, lines = launch(run_dir, hang_timeout=30)
    assert retry.exit_code == 0, "\n".join(lines)
    assert sorted(os.listdir(victim)) == ["precious.txt", "secret.json"]
    assert (victim / "precious.txt").read_text() == "keep me"
    assert (run_dir / owned).is_dir() and not (run_dir / owned).is_symlink()
    if owned == "exits":  # the retry's own records land in the real directory, none in the victim's
        assert [n for n in os.listdir(run_dir / "exits") if n.endswith(".json")] == ["rank0.restart0.json"]


def test_a_linked_result_is_not_the_jobs_result(tmp_path, victim):
    # Old code: metrics/result.json -> any JSON file on the worker became the job's result (XCom).
    result, _ = launch(tmp_path / "run", f"metrics/result.json={victim / 'secret.json'}")
    assert result.exit_code == 0
    assert result.metrics == {} and "AKIA-victim" not in json.dumps(result.to_xcom())


def test_a_linked_metrics_directory_is_not_read(tmp_path, victim):
    (victim / "result.json").write_text(json.dumps({"stolen": True}))
    result, _ = launch(tmp_path / "run", f"metrics={victim}")
    assert result.exit_code == 0 and result.metrics == {}
    # and the stall report reads no rank file through it either
    assert (result.stall or {}).get("world_size_seen", 0) == 0


def test_a_planted_exit_record_directory_does_not_fail_the_retry(tmp_path):
    # Old code: a directory planted in exits/ made the retry's cleanup raise IsADirectoryError.
    run_dir = tmp_path / "run"
    (run_dir / "exits" / "rank0.restart0.json").mkdir(parents=True)
    (run_dir / "exits" / "rank0.restart0.json" / "x").write_text("")
    result, lines = launch(run_dir)
    assert result.exit_code == 0, "\n".join(lines)
    assert (run_dir / "exits" / "rank0.restart0.json").is_file()


def test_the_deepspeed_config_is_never_written_through_a_planted_temp_link(tmp_path, victim):
    # Old code wrote <run_dir>/deepspeed_config.json.tmp with open(..., "w"): through a link there.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "deepspeed_config.json.tmp").symlink_to(victim / "precious.txt")
    spec = LaunchSpec(command=[sys.executable, PLANT], nodes=1, procs_per_node=1, device="cpu",
                      run_dir=str(run_dir), distribution="deepspeed",
                      deepspeed_config={"train_micro_batch_size_per_gpu": 2})
    job = prepare_job(spec)
    assert (victim / "precious.txt").read_text() == "keep me"
    config = json.loads((run_dir / "deepspeed_config.json").read_text())
    assert config["train_micro_batch_size_per_gpu"] == 2 and job.rank_env["DTRAIN_DEEPSPEED_CONFIG"].endswith(
        "deepspeed_config.json")


def test_a_run_directory_that_is_a_link_is_refused(tmp_path, victim):
    (tmp_path / "run").symlink_to(victim, target_is_directory=True)
    spec = LaunchSpec(command=[sys.executable, PLANT], nodes=1, procs_per_node=1, device="cpu",
                      run_dir=str(tmp_path / "run"))
    with pytest.raises(UnsafeRunDir, match="symlink"):
        prepare_job(spec)
    assert sorted(os.listdir(victim)) == ["precious.txt", "secret.json"]


def test_a_removed_hang_directory_does_not_stop_hang_enforcement(tmp_path):
    # Old code: the watch thread died on the request write (FileNotFoundError) and the hung job ran on.
    from dtrain.launch.engine import hang

    run_dir = tmp_path / "run"
    hung = tmp_path / "hung.py"
    hung.write_text("import os, shutil, time\n"
                    "shutil.rmtree(os.path.join(os.environ['DTRAIN_RUN_DIR'], 'hang'))\n"
                    "print('removed', flush=True)\n"
                    "time.sleep(120)\n")
    spec = LaunchSpec(command=[sys.executable, str(hung)], nodes=1, procs_per_node=1, device="cpu",
                      run_dir=str(run_dir), hang_timeout=3)
    lines: list[str] = []
    result = Launcher(spec, sink=lines.append).run()
    assert result.exit_code == hang.HANG_EXIT_CODE, "\n".join(lines)
    assert result.hang["stuck_ranks"] == [0]


def test_rundir_refuses_names_that_leave_it(tmp_path):
    run = RunDir(str(tmp_path))
    for bad in ("..", ".", "", "a/b"):
        assert run.read(bad, limit=10) is None
        with pytest.raises(OSError):
            run.write(bad, data=b"x")


def test_the_trigger_still_gives_a_verdict_when_a_rank_removed_the_hang_directory(tmp_path, monkeypatch):
    # Old code: request_dumps raised FileNotFoundError out of the trigger's loop (the deferred job
    # was then followed by nobody). The real trigger's hang step, on a job whose ranks went silent.
    import asyncio
    import time

    from dtrain.launch.airflow.trigger import DistributedJobTrigger
    from dtrain.launch.backends import JobHandle
    from dtrain.launch.engine import hang
    from dtrain.launch.node import hang_files

    run_dir = tmp_path / "run"
    for rank in (0, 1):
        hang_files.ProgressToucher(hang_files.progress_dir(str(run_dir)), rank).touch()
    started = time.time() - 60
    monkeypatch.setattr(hang, "DUMP_WAIT_S", 0.5)
    handle = JobHandle("ssh", "job", "job", str(run_dir), 2, started,
                       data={"hosts": ["a"], "ssh": {}, "detached": True}).to_dict()
    trigger = DistributedJobTrigger(handle=handle, poll_interval=2, hang_timeout=1)
    assert not (run_dir / "hang").exists()  # never made, or removed by a rank
    time.sleep(1.1)
    verdict = asyncio.run(trigger._hang_verdict())
    assert verdict is not None and verdict.stuck_ranks == [0, 1] and verdict.missing_stacks == [0, 1]
