"""The sbatch script, rendered by exact comparison; validation of every Slurm option; parsing
of Slurm's answers. Pure: no daemon needed (the real runs are in test_cluster.py)."""

from __future__ import annotations

import os
import shlex
import shutil
import string
import subprocess

import pytest

from dtrain.errors import SpecError
from dtrain.launch.backends.slurm.render import (
    EXTRA_SBATCH_ALLOWED, SBATCH_LONG_OPTIONS, SlurmOptions, coerce_options, decide, parse_job_id, parse_sacct,
    parse_scontrol_job, render_sbatch,
)
from dtrain.launch.core.job import Job
from dtrain.launch.core.spec import LaunchSpec

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
if [ -n "${DTRAIN_NODE_SECRETS+x}" ]; then exec 3<<<"$DTRAIN_NODE_SECRETS"; exec env -u DTRAIN_NODE_SECRETS /bin/bash "$0" "$@"; fi
node_secrets=; { IFS= read -r node_secrets <&3; exec 3<&-; } 2>/dev/null
cd '/shared/my code' || exit 1
export DTRAIN_DEVICE=gpu
export DTRAIN_JOB_ID=dtrain-abc123
export DTRAIN_RUN_DIR=/shared/runs/dtrain-abc123
export DTRAIN_STOP_GRACE=30
export HOSTILE='$(touch /tmp/pwned); `id` '"'"'quoted'"'"' "dq" 
 next'
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=30
export WANDB_MODE=offline
# A node's address: its NodeAddr in slurm.conf, else DNS; node names need not resolve.
dtrain_node_addr() {
  local addr
  addr=$(scontrol show node -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  if [ -z "$addr" ]; then addr=$(getent hosts "$1" | awk '{print $1; exit}'); fi
  printf '%s\n' "${addr:-$1}"
}
export DTRAIN_LOST_AFTER=30
MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_ADDR=$(dtrain_node_addr "$MASTER_NODE")
MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export MASTER_ADDR MASTER_PORT
echo "[dtrain] slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: rendezvous $MASTER_NODE ($MASTER_ADDR:$MASTER_PORT)"
srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --input=all --kill-on-bad-exit=1 bash -c 'export NODE_RANK="$SLURM_NODEID" DTRAIN_NODE_INDEX="$SLURM_NODEID" PET_NODE_RANK="$SLURM_NODEID" PET_MASTER_ADDR="$MASTER_ADDR" PET_MASTER_PORT="$MASTER_PORT"; py="$1"; node_secrets=; IFS= read -r node_secrets; reap() { "$py" -m dtrain.launch.node.proctree reap "$DTRAIN_JOB_ID" --node "$SLURM_NODEID"; }; printf '"'"'%s\n'"'"' "$node_secrets" | "$py" -m dtrain.launch.backends.slurm.node_lease --run-dir "$DTRAIN_RUN_DIR" --node "$SLURM_NODEID" --job-id "$DTRAIN_JOB_ID" --lease "$DTRAIN_LOST_AFTER" & DTRAIN_AGENT_PARENT=$$ "$@" & agent=$!; unset node_secrets; trap '"'"'kill -TERM "$agent" 2>/dev/null; wait "$agent"; reap; exit 143'"'"' TERM INT HUP; wait "$agent"; status=$?; reap; exit "$status"' dtrain-node \
  /opt/venv/bin/python -m dtrain.launch.node.torchrun_agent --nnodes=2 --nproc-per-node=4 --rdzv-backend=dtrain-static --rdzv-id=dtrain-abc123 --rdzv-conf=timeout=300 --max-restarts=0 --no-python /opt/venv/bin/python -m dtrain.launch.node.rank_entry train.py --lr 0.1 --tag '$(touch /tmp/pwned); `id` '"'"'quoted'"'"' "dq" 
 next' \
  <<<"$node_secrets"
status=$?
tmp=$(mktemp /shared/runs/dtrain-abc123/.slurm-"$SLURM_JOB_ID".exit.XXXXXX) && printf '%s\n' "$status" > "$tmp" && mv -f "$tmp" /shared/runs/dtrain-abc123/slurm-"$SLURM_JOB_ID".exit
# After a stop the launcher asked for (it SIGTERMed the ranks, which saved and exited), its cancel
# ends the job, so Slurm reports it CANCELLED rather than failed; bounded in case it never comes.
if [ -e /shared/runs/dtrain-abc123/slurm-"$SLURM_JOB_ID".stop ]; then sleep 30; fi
exit "$status"
"""


def test_sbatch_script_exact():
    options = SlurmOptions(partition="gpu", time_limit="2-00:00:00", account="ml-team", python="/opt/venv/bin/python",
                           extra_sbatch=("--qos=high", "--exclusive"))
    assert render_sbatch(make_job(), options, workdir="/shared/my code") == EXPECTED


def test_an_elastic_script_keeps_its_allocation_and_meets_at_the_launchers_store():
    """nodes=2:3: the allocation survives a node failure (--no-kill, sbatch and srun; no
    --kill-on-bad-exit), the agents meet at the launcher's store, each node leases against that store
    and records its end; no node rank from Slurm (each round gives its own)."""
    from dtrain.launch.backends.slurm.render import ELASTIC_NODE_SHELL
    from dtrain.launch.core.torchrun import Elastic

    spec = LaunchSpec(command=["train.py"], nodes="2:3", procs_per_node=4, backend="slurm", gpus_per_node=4)
    job = Job(spec=spec, job_id="dtrain-el1", run_dir="/shared/runs/dtrain-el1", rank_env={"DTRAIN_JOB_ID": "dtrain-el1"})
    text = render_sbatch(job, SlurmOptions(python="/py"), workdir="/w", rdzv=Elastic("10.0.0.1", 29411))
    lines = text.splitlines()
    assert lines[1:4] == ["#SBATCH --job-name=dtrain-el1", "#SBATCH --nodes=3", "#SBATCH --no-kill"]
    assert "export DTRAIN_LEASE_PEER=10.0.0.1:29411" in lines and not any("MASTER_" in line for line in lines)
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert lines[srun - 1] == ('echo "[dtrain] slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: elastic (2:3 nodes), '
                               'rendezvous store 10.0.0.1:29411"')
    assert lines[srun] == ("srun --nodes=3 --ntasks=3 --ntasks-per-node=1 --input=all --no-kill bash -c "
                           + shlex.quote(ELASTIC_NODE_SHELL) + " dtrain-node \\")
    assert lines[srun + 1] == (
        "  /py -m dtrain.launch.node.torchrun_agent --nnodes=2:3 --nproc-per-node=4 --rdzv-backend=dtrain-c10d "
        "--rdzv-endpoint=10.0.0.1:29411 --rdzv-id=dtrain-el1 --rdzv-conf=is_host=0,join_timeout=300,"
        "last_call_timeout=5,keep_alive_interval=3,keep_alive_max_attempt=3 --max-restarts=0 --no-python "
        "/py -m dtrain.launch.node.rank_entry train.py \\")
    assert lines[srun + 2] == '  <<<"$node_secrets"'  # the nodes' secrets: srun's stdin, every node's (--input=all)
    assert 'export DTRAIN_NODE_INDEX="$SLURM_NODEID"; ' in ELASTIC_NODE_SHELL and "NODE_RANK=" not in ELASTIC_NODE_SHELL
    assert '--peer "$DTRAIN_LEASE_PEER"' in ELASTIC_NODE_SHELL and 'record "$status"' in ELASTIC_NODE_SHELL
    with pytest.raises(Exception):  # an elastic script needs the store
        render_sbatch(job, SlurmOptions(python="/py"), workdir="/w")


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
                                                                       "dtrain.launch.node.rank_entry"]
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


# --- extra_sbatch: resolved like sbatch's getopt_long, then an allow-list --------------------

@pytest.mark.parametrize("item, resolved", [
    # the review's reproductions: abbreviations of reserved options, an unlisted option, a newline
    ("--out=x", "--output"),
    ("--chd=/tmp", "--chdir"),
    ("--ntasks-per-n=2", "--ntasks-per-node"),
    ("--export-file=f", "--export-file"),
    ("--qos=high\n", None),
    # variants
    ("--outp=/etc/passwd", "--output"),
    ("--output=/tmp/x", "--output"),
    ("--chdir=/tmp", "--chdir"),
    ("--export=ALL", "--export"),
    ("--export-f=f", "--export-file"),
    ("--err=/tmp/e", "--error"),
    ("--inp=/etc/shadow", "--input"),
    ("--open=append", "--open-mode"),
    ("--wra=id", "--wrap"),
    ("--arr=1-3", "--array"),
    ("--job=x", "--job-name"),
    ("--nodes=9", "--nodes"),
    ("--ntasks=9", "--ntasks"),
    ("--gpus-per-n=8", "--gpus-per-node"),
    ("--parsa", "--parsable"),
    ("--uid=0", "--uid"),
    ("--gid=0", "--gid"),
    ("--get-user-env", "--get-user-env"),
    ("--propagate", "--propagate"),
    ("--container=/tmp/bundle", "--container"),
    ("--bbf=/tmp/f", "--bbf"),
    ("--nodef=/tmp/f", "--nodefile"),
    ("--test-only", "--test-only"),
    ("--wait", "--wait"),
    ("--clusters=other", "--clusters"),
    ("--mail-user=x@evil.example", "--mail-user"),
    ("--hold", "--hold"),
    ("--qos=high\n#SBATCH --uid=0", None),
    ("--exclusive\n", None),
    ("--qos=high x", None),
    ("--qos='high'", None),
    ("--qos=$(id)", None),
    ("--qos=", None),
    ("-q high", None),
    ("--QOS=high", None),
])
def test_extra_sbatch_not_allowed_is_refused_naming_the_option(item, resolved):
    with pytest.raises(SpecError) as info:
        SlurmOptions(extra_sbatch=[item])
    assert info.value.field == "extra_sbatch" and info.value.value == item
    if resolved:
        assert f"sbatch reads it as {resolved}," in str(info.value)
    assert "--qos" in info.value.allowed  # what is allowed is named


@pytest.mark.parametrize("item, possibilities", [
    ("--ex=1", "--exclude, --exclusive, --export, --export-file, --extra-node-info"),
    ("--exc=n1", "--exclude, --exclusive"),
    ("--o=x", "--open-mode, --output, --overcommit, --oversubscribe"),
    ("--mem-per=1G", "--mem-per-cpu, --mem-per-gpu"),
    ("--cluster", None),  # exact: --clusters is never meant, and --cluster is not allowed either
])
def test_ambiguous_sbatch_abbreviation_is_refused(item, possibilities):
    with pytest.raises(SpecError) as info:
        SlurmOptions(extra_sbatch=[item])
    assert info.value.field == "extra_sbatch" and info.value.value == item
    if possibilities:
        assert f"as any of {possibilities};" in str(info.value)


@pytest.mark.parametrize("item, says", [
    ("--bogus=1", "--bogus is none"),
    ("--qos", "it takes a value"),  # else sbatch would take the next directive as its value
    ("--requeue=1", "--requeue without a value"),
    ("--contiguous=yes", "--contiguous without a value"),
    ("--nodelist=/etc/hosts", "no '/'"),  # with a "/", Slurm reads the node list from that file
    ("--exclude=../hosts", "no '/'"),
    (42, "text"),
])
def test_extra_sbatch_bad_form_is_refused(item, says):
    with pytest.raises(SpecError) as info:
        SlurmOptions(extra_sbatch=[item])
    assert info.value.field == "extra_sbatch" and says in info.value.allowed


@pytest.mark.parametrize("item, rendered", [
    ("--qos=high", "--qos=high"),
    ("--qo=high", "--qos=high"),                  # a unique prefix, written out in full
    ("--mem=64G", "--mem=64G"),                   # exact wins over --mem-bind/--mem-per-*
    ("--mem-per-g=8G", "--mem-per-gpu=8G"),
    ("--exclusive", "--exclusive"),
    ("--exclusive=user", "--exclusive=user"),
    ("--exclusi", "--exclusive"),
    ("--contig", "--contiguous"),
    ("--nice", "--nice"),
    ("--nice=10", "--nice=10"),
    ("--constraint=a100,ib", "--constraint=a100,ib"),
    ("--gres=gpu:a100:4", "--gres=gpu:a100:4"),
    ("--cpus-per-task=16", "--cpus-per-task=16"),
    ("--signal=B:USR1@90", "--signal=B:USR1@90"),
    ("--nodelist=gpu01,gpu02", "--nodelist=gpu01,gpu02"),
    ("--exclude=gpu03", "--exclude=gpu03"),
    ("--begin=now+60", "--begin=now+60"),
    ("--requeue", "--requeue"),
    ("--no-requeue", "--no-requeue"),
    ("--dependency=afterok:42", "--dependency=afterok:42"),
    ("--reservation=maint", "--reservation=maint"),
    ("--time-min=30", "--time-min=30"),
    ("--mail-type=END,FAIL", "--mail-type=END,FAIL"),
])
def test_allowed_extra_sbatch_is_resolved_and_rendered_in_full(item, rendered):
    options = SlurmOptions(extra_sbatch=[item], python="/py")
    assert options.extra_sbatch == (rendered,)
    spec = LaunchSpec(command=["t.py"], nodes=1, procs_per_node=1, backend="slurm", device="cpu")
    text = render_sbatch(Job(spec=spec, job_id="j1", run_dir="/r/j1"), options, workdir="/w")
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives[-1] == f"#SBATCH {rendered}"
    assert coerce_options({"extra_sbatch": [item]}).extra_sbatch == (rendered,)
    assert SlurmOptions(extra_sbatch=options.extra_sbatch).extra_sbatch == (rendered,)  # idempotent


def test_allow_list_names_only_real_sbatch_options():
    assert set(EXTRA_SBATCH_ALLOWED) <= SBATCH_LONG_OPTIONS
    for reserved in ("output", "error", "input", "chdir", "export", "export-file", "wrap", "array", "job-name",
                     "nodes", "ntasks", "ntasks-per-node", "gpus-per-node", "partition", "time", "account",
                     "parsable", "uid", "gid", "get-user-env", "open-mode", "container", "bbf", "nodefile",
                     "propagate", "test-only", "wait", "clusters", "cluster", "mail-user", "hold"):
        assert reserved in SBATCH_LONG_OPTIONS and reserved not in EXTRA_SBATCH_ALLOWED


def _sbatch_reads(prefix: str, conf: str, value: bool = False) -> tuple[str, object]:
    """What the installed sbatch makes of ``--prefix`` (its own getopt_long), without a controller:
    every probe ends in a parse error or an empty script (stdin is /dev/null), nothing is submitted."""
    proc = subprocess.run(["sbatch", f"--{prefix}=1" if value else f"--{prefix}"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_CONF": conf})
    first = (proc.stderr.splitlines() or [""])[0]
    if "is ambiguous; possibilities:" in first:
        return "ambiguous", {p.strip("'-") for p in first.split("possibilities:")[1].split()}
    if "unrecognized option" in first:
        return "unknown", None
    if "requires an argument" in first or "doesn't allow an argument" in first:
        return "option", first.split("option '--", 1)[1].split("'", 1)[0]
    return "other", first


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch (slurm-client) not installed")
def test_option_table_agrees_with_the_installed_sbatch(tmp_path):
    """Every one- and two-letter prefix, asked of the real sbatch: unknown, ambiguous (the same
    possibilities) or resolved (the same option) exactly as resolve_sbatch_option says. So
    SBATCH_LONG_OPTIONS is the installed sbatch's table; a new Slurm with other options fails here."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=probe\nSlurmctldHost=localhost\nSlurmctldPort=1\n")  # nothing listens
    letters = string.ascii_lowercase
    for prefix in [*letters, *(a + b for a in letters for b in letters + "-")]:
        kind, info = _sbatch_reads(prefix, str(conf))
        ours = sorted(o for o in SBATCH_LONG_OPTIONS if o.startswith(prefix))
        if prefix in SBATCH_LONG_OPTIONS:
            ours = [prefix]
        if kind == "unknown":
            assert ours == [], prefix
        elif kind == "ambiguous":
            assert set(ours) == info, prefix
        else:
            assert len(ours) == 1, (prefix, kind, info)
            if kind == "other":  # no argument needed: ask with one, to see the name
                kind, info = _sbatch_reads(prefix, str(conf), value=True)
            if kind == "option":
                assert info == ours[0], prefix
    for name in SBATCH_LONG_OPTIONS:  # and every name is one sbatch knows
        assert _sbatch_reads(name, str(conf))[0] != "unknown", name


@pytest.mark.parametrize("kwargs, field", [
    ({"partition": "gpu\n#SBATCH --uid=0"}, "partition"),
    ({"time_limit": "10\n#SBATCH --uid=0"}, "time_limit"),
    ({"account": "a\nb"}, "account"),
    ({"job_name": "j\n#SBATCH --chdir=/tmp"}, "job_name"),
    ({"python": "/opt/venv/bin/python\n"}, "python"),
    ({"python": "/opt/venv/bin/python\ntouch /tmp/pwned"}, "python"),
    ({"python": "/py\0"}, "python"),
    ({"python": "  "}, "python"),
])
def test_every_slurm_field_is_fully_matched(kwargs, field):
    with pytest.raises(SpecError) as info:
        SlurmOptions(**kwargs)
    assert info.value.field == field


def test_surrounding_blanks_of_a_field_are_dropped_before_the_full_match():
    options = SlurmOptions(partition=" gpu\n", time_limit="10\n", account="\tml ", job_name="j1 ")
    assert (options.partition, options.time_limit, options.account, options.job_name) == ("gpu", "10", "ml", "j1")


@pytest.mark.parametrize("run_dir", ["/shared/runs/x\n", "/shared/runs/x\n/y", "relative/x", "/a b"])
def test_run_dir_is_fully_matched(run_dir):
    job = make_job()
    job.run_dir = run_dir
    with pytest.raises(SpecError) as info:
        render_sbatch(job, SlurmOptions(python="/py"), workdir="/w")
    assert info.value.field == "run_dir"


@pytest.mark.parametrize("key", ["$(touch /tmp/x)X", "A\nB", "A\n", "A B", "A=B", "1A", "", "A;touch /tmp/x;B"])
def test_render_rechecks_env_keys_of_a_job_built_directly(key, tmp_path):
    """A Job built without LaunchSpec's checks: an env key reaches `export KEY=...` unquoted, so
    render_sbatch checks it against the shell grammar of a name itself."""
    job = make_job()
    job.rank_env = {**job.rank_env, key: "1"}
    with pytest.raises(SpecError) as info:
        render_sbatch(job, SlurmOptions(python="/py"), workdir="/w")
    assert info.value.field == "env key" and info.value.value == key


def test_render_refuses_nul_in_an_env_value_and_a_job_id_unsafe_as_job_name():
    job = make_job()
    job.rank_env = {"A": "x\0y"}
    with pytest.raises(SpecError):
        render_sbatch(job, SlurmOptions(python="/py"), workdir="/w")
    job = make_job()
    job.job_id = "j\n#SBATCH --chdir=/tmp"
    with pytest.raises(SpecError) as info:
        render_sbatch(job, SlurmOptions(python="/py"), workdir="/w")
    assert info.value.field == "job_id"
    assert "#SBATCH --job-name=given\n" in render_sbatch(job, SlurmOptions(python="/py", job_name="given"),
                                                          workdir="/w")


def test_render_rechecks_options_built_around_validation():
    options = SlurmOptions(python="/py")
    object.__setattr__(options, "extra_sbatch", ("--qos=high\n#SBATCH --chdir=/tmp",))
    with pytest.raises(SpecError) as info:
        render_sbatch(make_job(), options, workdir="/w")
    assert info.value.field == "sbatch directive"


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
