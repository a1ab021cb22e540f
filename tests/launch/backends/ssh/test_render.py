"""Pure renderers, compared exactly: ssh argv, the static-rendezvous torchrun agent, the remote
command string, mpirun's argv and environment, the generated ssh_config, TF_CONFIG."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess

import pytest

from dtrain.errors import SpecError
from dtrain.launch.backends.mpi.backend import mpi_hostfile_text
from dtrain.launch.backends.mpi.render import coerce_mpi_options, mpirun_argv, mpirun_env
from dtrain.launch.backends.ssh.backend import remote_agent_command, ssh_argv, ssh_config_text
from dtrain.launch.backends.ssh.hostfile import HostEntry, SSHSettings
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.core.torchrun import Static, agent_argv
from dtrain.launch.node.tf_config import cluster_spec, tf_config_env, tf_config_for_rank

PY = "/opt/venv/bin/python"
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun not installed")


def test_ssh_argv_per_host_user_and_port_win_over_the_settings():
    settings = SSHSettings(user="train", port=22, key_file="/k/id", known_hosts_file="/k/known",
                           strict_host_key_checking="yes", connect_timeout=7)
    host = HostEntry("[fd00::3]", 2, "alice", 2222)
    assert ssh_argv(settings, host, "echo hi") == [
        "ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=7",
        "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=6", "-o", "LogLevel=ERROR",
        "-o", "UserKnownHostsFile=/k/known", "-i", "/k/id", "-o", "IdentitiesOnly=yes",
        "-p", "2222", "-l", "alice", "--", "fd00::3", "echo hi",
    ]
    assert ssh_argv(SSHSettings(), HostEntry("w1"), "x")[-3:] == ["--", "w1", "x"]


def test_the_keepalive_gives_up_on_a_host_after_lost_after_seconds():
    """ssh's keepalive every 5 s, as many unanswered as lost_after allows (rounded up)."""
    def keepalive(settings):
        argv = ssh_argv(settings, HostEntry("w1"), "x")
        return [argv[i + 1] for i, word in enumerate(argv) if word == "-o" and argv[i + 1].startswith("ServerAlive")]

    assert keepalive(SSHSettings.from_mapping({"lost_after": 12})) == ["ServerAliveInterval=5", "ServerAliveCountMax=3"]
    assert keepalive(SSHSettings.from_mapping({})) == ["ServerAliveInterval=5", "ServerAliveCountMax=6"]
    for bad in (5, "x", float("nan"), 10**6):
        with pytest.raises(SpecError) as e:
            SSHSettings.from_mapping({"lost_after": bad})
        assert e.value.field == "ssh.lost_after"


def test_a_detached_node_leases_against_node_0_and_node_0_against_node_1():
    from dtrain.launch.backends.ssh.detached import lease_options
    from dtrain.launch.backends.ssh.hostfile import coerce_hosts

    hosts = coerce_hosts(["10.0.0.11", "root@10.0.0.12:2222", "[fd00::3]"])
    settings = SSHSettings(port=2200, lost_after=40)
    assert [lease_options(hosts, i, settings) for i in range(3)] == [
        ["--lease", "40", "--peer", "10.0.0.12:2222"],
        ["--lease", "40", "--peer", "10.0.0.11:2200"],
        ["--lease", "40", "--peer", "10.0.0.11:2200"],
    ]
    assert lease_options(hosts[2:], 0, SSHSettings()) == ["--lease", "30"]  # alone: fenced only when frozen
    assert lease_options([hosts[1], hosts[2]], 0, SSHSettings())[-1] == "[fd00::3]:22"


def test_the_daemon_gets_the_peer_as_start_got_it():
    # start re-execs itself as the daemon with its own options: an IPv6 peer must keep its brackets there
    from dtrain.launch.backends.ssh.detached_node import daemon_argv, parse_args

    start = parse_args(["start", "--run-dir", "/run", "--node", "1", "--job-id", "j", "--lease", "30",
                        "--peer", "[fd00::3]:2222", "--", "torchrun"])
    argv = daemon_argv(start)
    daemon = parse_args(argv[argv.index("daemon"):])
    assert (start.peer_address, daemon.peer_address, daemon.lease) == (("fd00::3", 2222), ("fd00::3", 2222), 30.0)


def test_static_agent_argv_fixes_the_node_rank():
    spec = LaunchSpec(command=["train.py", "--lr", "0.1"], nodes=2, procs_per_node=4, backend="ssh",
                      backend_options={"hosts": ["a slots=4", "b slots=4"]}, rdzv_timeout=90)
    argv = agent_argv(spec, python=PY, job_id="job1", rdzv=Static(endpoint=("a", 29400), node_rank=1))
    assert argv == [
        PY, "-m", "dtrain.launch.node.torchrun_agent", "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=dtrain-static",
        "--rdzv-endpoint=a:29400", "--rdzv-id=job1", "--rdzv-conf=timeout=90", "--node-rank=1",
        "--max-restarts=0", "--no-python", PY, "-m", "dtrain.launch.node.rank_entry", "train.py", "--lr", "0.1",
    ]


def test_remote_command_is_one_quoted_string_that_splits_back_verbatim():
    hostile = ["$(touch /tmp/pwned); x", "`id`", "a b", "'", '"', "\\", "*", "\n"]
    command = remote_agent_command(PY, job_id="j", node_index=0, pgid_file="/runs/j/remote/node0.pgid",
                                   workdir="/work dir", grace=5.0, lease=30.0, agent=["torchrun", *hostile])
    assert shlex.split(command) == [PY, "-m", "dtrain.launch.backends.ssh.remote_agent", "--job-id", "j", "--node", "0",
                                    "--pgid-file", "/runs/j/remote/node0.pgid", "--workdir", "/work dir",
                                    "--grace", "5", "--lease", "30", "--", "torchrun", *hostile]


def test_mpirun_argv_over_ssh_hosts():
    argv = mpirun_argv(nodes=2, procs_per_node=4, python=PY, command=["train.py", "--epochs", "3"],
                       export=["DTRAIN_RUN_DIR", "MASTER_ADDR", "MASTER_PORT"], hostfile="/run/mpi/hostfile",
                       rsh_agent="ssh -F /run/mpi/ssh_config", workdir="/work",
                       user_options=coerce_mpi_options(["-x NCCL_DEBUG=VERSION", "--oversubscribe"]))
    assert argv == [
        "mpirun", "--hostfile", "/run/mpi/hostfile", "-np", "8", "--map-by", "ppr:4:node", "--bind-to", "none",
        "--mca", "plm_rsh_agent", "ssh -F /run/mpi/ssh_config", "--wdir", "/work",
        "-x", "DTRAIN_RUN_DIR", "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
        "-x", "NCCL_DEBUG=VERSION", "--oversubscribe",
        PY, "-m", "dtrain.launch.node.rank_entry", "train.py", "--epochs", "3",
    ]


def test_mpirun_argv_on_this_host():
    assert mpirun_argv(nodes=1, procs_per_node=2, python=PY, command=["t.py"], export=[]) == [
        "mpirun", "--host", "localhost:2", "-np", "2", "--map-by", "ppr:2:node", "--bind-to", "none",
        PY, "-m", "dtrain.launch.node.rank_entry", "t.py",
    ]


def test_mpirun_env_allows_root_only_for_root():
    assert mpirun_env({"A": "1"}, euid=0) == {"A": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                                              "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    assert mpirun_env({"A": "1"}, euid=1000) == {"A": "1"}


@pytest.mark.parametrize("options, tokens", [
    (["-x NCCL_DEBUG=VERSION"], ["-x", "NCCL_DEBUG=VERSION"]),
    ("--mca btl_tcp_if_include lo --bind-to core", ["--mca", "btl_tcp_if_include", "lo", "--bind-to", "core"]),
    (["-mca pml ob1", "--tag-output"], ["-mca", "pml", "ob1", "--tag-output"]),
    (["-x 'MSG=a b'"], ["-x", "MSG=a b"]),
    (["-x NCCL_DEBUG", "--x NCCL_SOCKET_IFNAME=eth0"], ["-x", "NCCL_DEBUG", "--x", "NCCL_SOCKET_IFNAME=eth0"]),
    ("-mca btl ^openib --gmca btl_tcp_if_include 10.0.0.0/8",
     ["-mca", "btl", "^openib", "--gmca", "btl_tcp_if_include", "10.0.0.0/8"]),
    ("--mca pml ucx --mca pml_ucx_devices mlx5_*", ["--mca", "pml", "ucx", "--mca", "pml_ucx_devices", "mlx5_*"]),
    ("--map-by ppr:2:node:PE=4 --bind-to core:overload-allowed --cpus-per-proc 4 -oversubscribe -v",
     ["--map-by", "ppr:2:node:PE=4", "--bind-to", "core:overload-allowed", "--cpus-per-proc", "4",
      "-oversubscribe", "-v"]),
])
def test_allowed_mpi_options(options, tokens):
    assert coerce_mpi_options(options) == tokens


@pytest.mark.parametrize("options, value", [
    (["--mca plm_rsh_agent /tmp/evil"], "--mca plm_rsh_agent"),
    (["-mca orte_launch_agent evil"], "-mca orte_launch_agent"),
    (["--launch-agent /tmp/evil"], "--launch-agent"),
    (["--prefix /tmp"], "--prefix"),
    (["-x"], "-x"),
    (["-x $(id)"], "$(id)"),
    (["--mca pml"], "--mca pml"),
    (["-x 'unbalanced"], "-x 'unbalanced"),
])
def test_refused_mpi_options_are_named(options, value):
    with pytest.raises(SpecError) as err:
        coerce_mpi_options(options)
    assert err.value.field == "mpi_options" and err.value.value == value


@pytest.mark.parametrize("options, value", [
    # the review's reproductions: an MCA file of more parameters (orte_fork_agent = evil.sh in it),
    # a component path, the fork agent by environment, a preloaded library
    (["--mca mca_base_param_files /tmp/evil/params.conf"], "--mca mca_base_param_files"),
    (["--mca mca_base_component_path /tmp/evil"], "--mca mca_base_component_path"),
    (["-x OMPI_MCA_orte_fork_agent=/tmp/evil.sh"], "OMPI_MCA_orte_fork_agent"),
    (["-x LD_PRELOAD=/tmp/evil.so"], "LD_PRELOAD"),
    # variants: other spellings, other MCA parameters by name or by environment
    (["-mca mca_base_param_files /tmp/p.conf"], "-mca mca_base_param_files"),
    (["--gmca mca_base_param_files /tmp/p.conf"], "--gmca mca_base_param_files"),
    (["--mca orte_fork_agent /tmp/evil.sh"], "--mca orte_fork_agent"),
    (["--mca mca_base_env_list LD_PRELOAD=/tmp/evil.so"], "--mca mca_base_env_list"),
    (["--mca opal_event_include x --mca btl self"], "--mca opal_event_include"),
    (["--mca BTL self"], "--mca BTL"),
    (["--x OMPI_MCA_orte_fork_agent=/tmp/evil.sh"], "OMPI_MCA_orte_fork_agent"),
    (["-x OMPI_MCA_mca_base_param_files=/tmp/p.conf"], "OMPI_MCA_mca_base_param_files"),
    (["-x OMPI_MCA_plm_rsh_agent"], "OMPI_MCA_plm_rsh_agent"),  # forwarded from mpirun's environment
    (["-x OPAL_PREFIX=/tmp/evil"], "OPAL_PREFIX"),
    (["-x PMIX_MCA_mca_base_component_path=/tmp"], "PMIX_MCA_mca_base_component_path"),
    (["-x LD_LIBRARY_PATH=/tmp/evil"], "LD_LIBRARY_PATH"),
    (["-x LD_AUDIT=/tmp/evil.so"], "LD_AUDIT"),
    (["-x PATH=/tmp/evil:/usr/bin"], "PATH"),
    (["-x PYTHONPATH=/tmp/evil"], "PYTHONPATH"),
    (["-x PYTHONSTARTUP=/tmp/evil.py"], "PYTHONSTARTUP"),
    (["-x BASH_ENV=/tmp/evil.sh"], "BASH_ENV"),
    (["-x RANK=0"], "RANK"),                      # the env contract
    (["-x MASTER_ADDR=evil.example"], "MASTER_ADDR"),
    (["-x DTRAIN_RUN_DIR=/tmp"], "DTRAIN_RUN_DIR"),
    (["-x OMPI_COMM_WORLD_RANK=0"], "OMPI_COMM_WORLD_RANK"),
    (["-x SLURM_PROCID=0"], "SLURM_PROCID"),
    (["-x =x"], ""),
    # mpirun 4.1 resolves no abbreviation: these are unknown to it, and refused here
    (["--oversub"], "--oversub"),
    (["--mc btl self"], "--mc"),
    (["--launch-a /tmp/evil"], "--launch-a"),
    # forms mpirun reads otherwise, or options that name a file or a program
    (["-vq"], "-vq"),
    (["--mca=btl self"], "--mca=btl"),
    (["---mca btl self"], "---mca"),
    (["-am /tmp/p.conf"], "-am"),
    (["--tune /tmp/p.conf"], "--tune"),
    (["--app /tmp/appfile"], "--app"),
    (["--hostfile /tmp/hosts"], "--hostfile"),
    (["--wdir /tmp"], "--wdir"),
    (["--path /tmp/evil"], "--path"),
    (["--preload-files /tmp/f"], "--preload-files"),
    (["--output-filename /tmp/o"], "--output-filename"),
    (["--debugger /tmp/evil"], "--debugger"),
    (["--", "/tmp/evil"], "--"),
    (["/tmp/evil"], "/tmp/evil"),
    # values: never an option, only the alphabet
    (["--bind-to -x"], "-x"),
    (["--map-by", "ppr:1:node;id"], "ppr:1:node;id"),
    (["--mca btl -x"], "-x"),
    (["--mca btl 'self\n'"], "self\n"),
    (["--cpus-per-proc 0"], "0"),
])
def test_mpi_options_that_could_run_a_program_are_refused(options, value):
    with pytest.raises(SpecError) as err:
        coerce_mpi_options(options)
    assert err.value.field == "mpi_options" and err.value.value == value


def test_mpirun_argv_rechecks_options_and_refuses_openmpi_variables_in_the_exported_env():
    """mpirun_argv does not trust its caller: the user's options are checked again, and an
    exported variable of OpenMPI's own (which sits in mpirun's environment too, where mpirun reads
    it: OMPI_MCA_orte_fork_agent there runs the agent) is refused."""
    with pytest.raises(SpecError) as err:
        mpirun_argv(nodes=1, procs_per_node=1, python=PY, command=["t.py"], export=[],
                    user_options=["--mca", "mca_base_param_files", "/tmp/p.conf"])
    assert err.value.field == "mpi_options"
    for name in ("OMPI_MCA_orte_fork_agent", "OPAL_PREFIX", "PMIX_MCA_x", "A B", "$(id)"):
        with pytest.raises(SpecError) as err:
            mpirun_argv(nodes=1, procs_per_node=1, python=PY, command=["t.py"], export=["MASTER_ADDR", name])
        assert err.value.field == "env key" and err.value.value == name


@needs_mpirun
def test_mpi_backend_refuses_an_openmpi_variable_in_the_job_env(tmp_path):
    """The same bypass through the spec's env: the job's variables are also mpirun's own. Refused
    when the spec is validated, before a run directory exists."""
    (tmp_path / "t.py").write_text("")
    with pytest.raises(SpecError) as err:
        LaunchSpec(command=["t.py"], nodes=1, procs_per_node=1, backend="local", distribution="mpi",
                   device="cpu", workdir=str(tmp_path), run_dir=str(tmp_path / "run"),
                   env={"OMPI_MCA_orte_fork_agent": "/tmp/evil.sh"})
    assert err.value.value == "OMPI_MCA_orte_fork_agent" and not (tmp_path / "run").exists()


def _mpirun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mpirun", *args], capture_output=True, text=True, timeout=60,
                          env=mpirun_env({k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_")}))


@needs_mpirun
def test_the_real_mpirun_resolves_no_abbreviation_and_reads_single_dash_long_options():
    """What option_name assumes, asked of the installed mpirun (OpenMPI 4.1): a prefix is an
    unknown option; -NAME is --NAME; --x is -x."""
    for token in ("--oversub", "--mc", "--bind-t", "--mca=btl"):
        proc = _mpirun(token, "btl", "self", "-np", "1", "true")
        assert proc.returncode != 0 and f'unknown option "{token}"' in proc.stderr, proc.stderr
    proc = _mpirun("-oversubscribe", "-mca", "btl", "self", "-bind-to", "none", "--x", "DTRAIN_PROBE=1",
                   "-np", "1", "printenv", "DTRAIN_PROBE")
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr


@needs_mpirun
def test_accepted_mpi_options_run_with_the_real_mpirun():
    options = coerce_mpi_options([
        "--oversubscribe --report-bindings --tag-output --timestamp-output --display-map --display-allocation",
        "--use-hwthread-cpus -v -q --bind-to none --map-by slot --rank-by slot",
        "--mca btl ^openib -mca pml ob1 --gmca btl_tcp_if_include lo --mca btl_vader_single_copy_mechanism none",
        "--mca orte_base_help_aggregate 0 --mca mpi_warn_on_fork 0 --mca rmaps_base_oversubscribe 1",
        "-x NCCL_DEBUG=VERSION",
    ])
    proc = _mpirun(*options, "-np", "1", "printenv", "NCCL_DEBUG")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("VERSION"), proc.stderr


def test_generated_ssh_config_and_mpi_hostfile():
    settings = SSHSettings(user="train", key_file="/k/id", known_hosts_file="/k/known",
                           strict_host_key_checking="yes", connect_timeout=10, lost_after=12)
    hosts = [HostEntry("127.0.0.1", 2, None, 2201), HostEntry("gpu-2", 2, "alice", None)]
    assert ssh_config_text(hosts, settings) == (
        "Host dtrain-node0\n  HostName 127.0.0.1\n  BatchMode yes\n  StrictHostKeyChecking yes\n"
        "  ConnectTimeout 10\n  ServerAliveInterval 5\n  ServerAliveCountMax 3\n  LogLevel ERROR\n  Port 2201\n  User train\n  IdentityFile /k/id\n"
        "  IdentitiesOnly yes\n  UserKnownHostsFile /k/known\n"
        "Host dtrain-node1\n  HostName gpu-2\n  BatchMode yes\n  StrictHostKeyChecking yes\n"
        "  ConnectTimeout 10\n  ServerAliveInterval 5\n  ServerAliveCountMax 3\n  LogLevel ERROR\n  User alice\n  IdentityFile /k/id\n"
        "  IdentitiesOnly yes\n  UserKnownHostsFile /k/known\n"
    )
    assert mpi_hostfile_text(len(hosts), 2) == "dtrain-node0 slots=2\ndtrain-node1 slots=2\n"


def test_tf_config_workers_only():
    assert tf_config_for_rank(3, ["h0", "h1"], 2, 2222) == {
        "cluster": {"worker": ["h0:2222", "h0:2223", "h1:2224", "h1:2225"]},
        "task": {"type": "worker", "index": 3},
        "environment": "cloud",
    }


def test_tf_config_with_parameter_servers():
    # 3 hosts x 2 processes, 2 of them parameter servers (the last two ranks).
    assert cluster_spec(["h0", "h1", "h2"], 2, 5000, num_ps=2) == {
        "worker": ["h0:5000", "h0:5001", "h1:5002", "h1:5003"],
        "ps": ["h2:5004", "h2:5005"],
    }
    assert tf_config_for_rank(5, ["h0", "h1", "h2"], 2, 5000, num_ps=2) == {
        "cluster": {"worker": ["h0:5000", "h0:5001", "h1:5002", "h1:5003"], "ps": ["h2:5004", "h2:5005"]},
        "task": {"type": "ps", "index": 1},
        "environment": "cloud",
    }
    assert tf_config_for_rank(0, ["h0", "h1", "h2"], 2, 5000, num_ps=2)["task"] == {"type": "worker", "index": 0}
    with pytest.raises(ValueError):
        cluster_spec(["h0"], 1, num_ps=1)


def test_tf_config_env_from_the_rank_environment():
    environ = {"DTRAIN_TF_HOSTS": "10.0.0.1,10.0.0.2", "DTRAIN_TF_PORT": "7000", "DTRAIN_TF_NUM_PS": "1",
               "RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert json.loads(tf_config_env(environ)["TF_CONFIG"]) == {
        "cluster": {"worker": ["10.0.0.1:7000", "10.0.0.1:7001", "10.0.0.2:7002"], "ps": ["10.0.0.2:7003"]},
        "task": {"type": "worker", "index": 1},
        "environment": "cloud",
    }
    assert tf_config_env({**environ, "TF_CONFIG": "{}"}) == {}  # the user's own wins
    assert tf_config_env({"RANK": "0", "WORLD_SIZE": "1"}) == {}  # not a tensorflow job
