"""A rank of a real Slurm job plants links where the batch script and the launcher write and read
(issue 22): the job log ``slurm-<id>.out`` replaced by a link to a file with credentials, and the
batch script's ``slurm-<id>.exit.tmp`` by a link to a file someone else owns."""

from __future__ import annotations

import sys

from dtrain.launch.engine.launcher import Launcher

from tests.launch.conftest import script

from ..conftest import cpu_spec, queue


def test_a_rank_cannot_make_the_launcher_read_or_write_through_its_links(slurm, tmp_path):
    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key=AKIA-victim\n" * 3)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    run_dir = tmp_path / "run"
    spec = cpu_spec([sys.executable, script("plant.py"), f"slurm-{{SLURM_JOB_ID}}.out={secret}",
                     f"slurm-{{SLURM_JOB_ID}}.exit.tmp={victim}", "--exit", "3", "--print", "planted"],
                    nodes=1, procs_per_node=1, run_dir=str(run_dir), backend_options={"poll_interval": 0.3})
    lines: list[str] = []
    result = Launcher(spec, sink=lines.append).run()
    # Old code: the follower and the failure's tail streamed the credentials into the task log, and
    # the batch script's `printf > .exit.tmp` wrote the exit status into the victim file.
    assert "AKIA-victim" not in "\n".join(lines) + str(result.to_xcom())
    assert victim.read_text() == "keep me\n"
    assert result.exit_code == 3, "\n".join(lines)
    assert queue(slurm) == []
