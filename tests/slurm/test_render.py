"""The sbatch script, rendered by exact comparison; validation of every Slurm option; parsing
of Slurm's answers. Pure: no daemon needed (the real runs are in test_cluster.py)."""

from __future__ import annotations

import pytest

from dtrain.errors import SpecError
from dtrain.launch.backends.slurm.render import (
    SlurmOptions, coerce_options, decide, parse_job_id, parse_sacct, parse_scontrol_job, render_sbatch,
)
from dtrain.launch.job import Job
from dtrain.launch.spec import LaunchSpec

HOSTILE = "$(touch /tmp/pwned); `id` 'quoted' \"dq\" \n next"


def make_job(**spec_kwargs) -> Job:
    spec = LaunchSpec(command=["train.py", "--lr", "0.1", "--tag", HOSTILE], nodes=2, procs_per_node=4,
                      backend="slurm", gpus_per_node=4, env={"WANDB_MODE": "offline", "HOSTILE": HOSTILE},
                      **spec_kwargs)
    return Job(spec=spec, job_id="dtrain-abc123", run_dir="/shared/runs/dtrain-abc123",
               rank_env={"DTRAIN_JOB_ID": "dtrain-abc123", "DTRAIN_RUN_DIR": "/shared/runs/dtrain-abc123",
                         "DTRAIN_DEVICE": "gpu", **spec.env})


EXPECTED = r"""#!/bin/bash
#SBATCH --job-name=dtrain-abc123
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --time=2-00:00:00
#SBATCH --partition=gpu
#SBATCH --account=ml-team
#SBATCH --output=/shared/runs/dtrain-abc123/slurm-%j.out
#SBATCH --qos=high
#SBATCH --exclusive
# Rendered by airflow-dtrain: srun starts one torchrun agent per node.
set -uo pipefail
cd '/shared/my code' || exit 1
export DTRAIN_DEVICE=gpu
export DTRAIN_JOB_ID=dtrain-abc123
export DTRAIN_RUN_DIR=/shared/runs/dtrain-abc123
export HOSTILE='$(touch /tmp/pwned); `id` '"'"'quoted'"'"' "dq" 
 next'
export WANDB_MODE=offline
# A node's address: its NodeAddr in slurm.conf, else DNS; node names need not resolve.
dtrain_node_addr() {
  local addr
  addr=$(scontrol show node -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  if [ -z "$addr" ]; then addr=$(getent hosts "$1" | awk '{print $1; exit}'); fi
  printf '%s\n' "${addr:-$1}"
}
MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_ADDR=$(dtrain_node_addr "$MASTER_NODE")
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
echo "[dtrain] slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: rendezvous $MASTER_NODE ($MASTER_ADDR:$MASTER_PORT)"
srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'export NODE_RANK="$SLURM_NODEID" DTRAIN_NODE_INDEX="$SLURM_NODEID" PET_NODE_RANK="$SLURM_NODEID" PET_MASTER_ADDR="$MASTER_ADDR" PET_MASTER_PORT="$MASTER_PORT"; exec "$@"' dtrain-node \
  /opt/venv/bin/python -m torch.distributed.run --nnodes=2 --nproc-per-node=4 --rdzv-backend=static --rdzv-id=dtrain-abc123 --rdzv-conf=timeout=300 --max-restarts=0 --no-python /opt/venv/bin/python -m dtrain.launch.rank_entry train.py --lr 0.1 --tag '$(touch /tmp/pwned); `id` '"'"'quoted'"'"' "dq" 
 next'
status=$?
printf '%s\n' "$status" > /shared/runs/dtrain-abc123/slurm-"$SLURM_JOB_ID".exit.tmp && mv -f /shared/runs/dtrain-abc123/slurm-"$SLURM_JOB_ID".exit.tmp /shared/runs/dtrain-abc123/slurm-"$SLURM_JOB_ID".exit
exit "$status"
"""


def test_sbatch_script_exact():
    options = SlurmOptions(partition="gpu", time_limit="2-00:00:00", account="ml-team", python="/opt/venv/bin/python",
                           extra_sbatch=("--qos=high", "--exclusive"))
    assert render_sbatch(make_job(), options, workdir="/shared/my code") == EXPECTED


def test_hostile_values_reach_the_program_verbatim_through_real_bash(tmp_path):
    """Run the whole rendered script in real bash, with srun and scontrol replaced by functions
    that record what they get: the hostile value arrives as one argument and as the env value,
    unchanged, nothing in it ran, and the script records srun's exit status."""
    import os
    import subprocess

    job = make_job()
    job.run_dir = str(tmp_path)
    text = render_sbatch(job, SlurmOptions(python="/opt/venv/bin/python"), workdir=str(tmp_path))
    stubs = ('scontrol() { echo n1; }\n'
             'srun() { printf "%s\\0" "$@" > argv.bin; printf "%s" "$HOSTILE" > env.txt; return 3; }\n')
    proc = subprocess.run(["bash", "-c", stubs + text], capture_output=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "17", "SLURM_JOB_NODELIST": "n1"})
    assert proc.returncode == 3, proc.stderr
    argv = (tmp_path / "argv.bin").read_bytes().decode().split("\0")[:-1]
    assert argv[-2:] == ["--tag", HOSTILE]
    assert argv[argv.index("train.py") - 3:argv.index("train.py")] == ["/opt/venv/bin/python", "-m",
                                                                       "dtrain.launch.rank_entry"]
    assert (tmp_path / "env.txt").read_text() == HOSTILE
    assert (tmp_path / "slurm-17.exit").read_text() == "3\n"  # srun's status, recorded for the poller
    assert not os.path.exists("/tmp/pwned") and not (tmp_path / "pwned").exists()


def test_minimal_script_defaults_and_fixed_port():
    spec = LaunchSpec(command=["python", "-m", "pkg.train"], nodes=3, procs_per_node=1, backend="slurm", device="cpu")
    job = Job(spec=spec, job_id="j1", run_dir="/r/j1", rank_env={"DTRAIN_DEVICE": "cpu"})
    text = render_sbatch(job, SlurmOptions(python="/py", master_port=29400), workdir="/w")
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == ["#SBATCH --job-name=j1", "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1",
                          "#SBATCH --output=/r/j1/slurm-%j.out"]
    assert "\nMASTER_PORT=29400\n" in text
    assert "--nnodes=3 --nproc-per-node=1 " in text
    assert text.rstrip().endswith('exit "$status"')


@pytest.mark.parametrize("kwargs, field", [
    ({"partition": "gpu; rm -rf /"}, "partition"),
    ({"partition": "gpu\n#SBATCH --uid=0"}, "partition"),
    ({"time_limit": "1 hour"}, "time_limit"),
    ({"time_limit": "1:00:00$(id)"}, "time_limit"),
    ({"account": "a b"}, "account"),
    ({"job_name": "x'y"}, "job_name"),
    ({"gpus_per_node": -1}, "gpus_per_node"),
    ({"gpus_per_node": "many"}, "gpus_per_node"),
    ({"extra_sbatch": ("--qos=high x",)}, "extra_sbatch"),
    ({"extra_sbatch": ("--output=/etc/passwd",)}, "extra_sbatch"),
    ({"extra_sbatch": ("-p x",)}, "extra_sbatch"),
    ({"poll_interval": 0}, "poll_interval"),
    ({"master_port": 70000}, "master_port"),
])
def test_bad_slurm_options_name_the_field(kwargs, field):
    with pytest.raises(SpecError) as info:
        SlurmOptions(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize("value", ["90", "1:30", "1:30:00", "2-0", "2-00:30", "2-00:30:00", "UNLIMITED"])
def test_slurm_time_formats_accepted(value):
    assert SlurmOptions(time_limit=value).time_limit == value


def test_run_dir_unsafe_on_sbatch_line_is_refused():
    job = make_job()
    job.run_dir = "/shared/runs/with space"
    with pytest.raises(SpecError, match="run_dir"):
        render_sbatch(job, SlurmOptions(), workdir="/w")


def test_options_from_operator_argument():
    assert coerce_options(None) == SlurmOptions()
    assert coerce_options('{"partition": "gpu", "time_limit": "10"}').partition == "gpu"
    assert coerce_options({"account": "a"}).account == "a"
    with pytest.raises(SpecError, match="known keys"):
        coerce_options({"partiton": "gpu"})
    with pytest.raises(SpecError):
        coerce_options(["gpu"])


def test_parse_slurm_answers():
    line = ("JobId=42 JobName=dtrain-x UserId=root(0) GroupId=root(0) JobState=FAILED Reason=NonZeroExitCode "
            "Dependency=(null) ExitCode=7:0 RunTime=00:00:03 NodeList=node[1-2] Command=/r/slurm-job.sh")
    fields = parse_scontrol_job(line)
    assert fields == {"JobId": "42", "JobState": "FAILED", "ExitCode": "7:0", "Reason": "NonZeroExitCode",
                      "NodeList": "node[1-2]"}
    assert parse_sacct("42|CANCELLED by 0|0:15\n") == {"JobId": "42", "JobState": "CANCELLED", "ExitCode": "0:15"}
    assert parse_job_id("42\n") == "42" and parse_job_id("43;cluster\n") == "43"
    with pytest.raises(Exception, match="job id"):
        parse_job_id("sbatch: error: Batch job submission failed")


@pytest.mark.parametrize("fields, record, done, code", [
    ({"JobState": "RUNNING"}, None, False, None),
    ({"JobState": "COMPLETING", "ExitCode": "0:0"}, None, False, None),  # processes still being killed
    ({"JobState": "PENDING"}, None, False, None),
    ({"JobState": "COMPLETED", "ExitCode": "0:0"}, 0, True, 0),
    ({"JobState": "FAILED", "ExitCode": "1:0"}, 1, True, 1),           # the script's record wins
    ({"JobState": "FAILED", "ExitCode": "7:0"}, None, True, 7),
    ({"JobState": "CANCELLED", "ExitCode": "0:15"}, None, True, 143),
    ({"JobState": "TIMEOUT", "ExitCode": "0:0"}, None, True, 124),
    ({"JobState": "NODE_FAIL", "ExitCode": "0:0"}, None, True, 1),
    ({}, 0, True, 0),                                                   # Slurm forgot it; the record remains
    ({}, 3, True, 3),
    ({}, None, True, 1),                                                # forgotten, no record: failed
])
def test_decide_status(fields, record, done, code):
    status = decide("42", fields, record)
    assert (status.done, status.exit_code) == (done, code)
