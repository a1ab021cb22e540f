"""Options declared once (dtrain.options): the job's table is what the spec's fields, the
``dtrain launch`` flags, the operator's parameters and ``template_fields``, the checks and the docs'
table are; and one option added to a table shows up in all of them."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os

import pytest

from dtrain.errors import SpecError
from dtrain.options import Option, Options, integer
from dtrain.launch.core.spec_options import JOB_OPTIONS
from tests.conftest import REPO

DOC = os.path.join(REPO, "docs", "backends.md")
#: an option a test adds: the table is the only place it is declared
WARMUP = Option("warmup_steps", int, 3, "optimizer steps before the learning rate peaks", templated=True,
                check=integer(0, 1000))


def launch_parser() -> argparse.ArgumentParser:
    from dtrain.launch.engine import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser


def parse_launch(*argv: str) -> argparse.Namespace:
    return launch_parser().parse_args(["launch", *argv, "--", "train.py"])


def test_the_spec_has_one_field_per_option_with_its_default():
    from dtrain.launch.core.spec import LaunchSpec

    fields = {f.name: f for f in LaunchSpec.__dataclass_fields__.values()}  # the placement's keywords too (InitVar)
    for option in JOB_OPTIONS:
        f = fields[option.name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert default == option.default, option.name
    # what is no option: the command, what the operator's connection fills, and what the spec derives
    assert set(fields) - set(JOB_OPTIONS.names) == {"command", "secret_env", "placement", "resolved_deepspeed_config"}


def test_the_launch_flags_are_the_tables_with_its_defaults():
    args = parse_launch()
    values = JOB_OPTIONS.from_args(args)
    flagged = [o for o in JOB_OPTIONS if o.cli_flag]
    assert set(values) == {o.name for o in flagged}
    for option in flagged:
        assert values[option.name] == option.default, option.name
    values = JOB_OPTIONS.from_args(parse_launch("--env", "A=1", "--mpi-option=-x B", "--mpi-option=-x C",
                                                "--hang-timeout", "60", "--procs-per-node", "2"))
    assert values["env"] == {"A": "1"} and values["mpi_options"] == ["-x B", "-x C"]
    assert values["hang_timeout"] == 60.0 and values["procs_per_node"] == 2


def test_the_operators_parameters_and_template_fields_are_the_tables():
    from dtrain.launch.airflow.operator import DistributedTrainingOperator as Op

    params = inspect.signature(Op.__init__).parameters
    for option in JOB_OPTIONS:
        if option.operator:
            assert params[option.name].default == option.keyword_default, option.name
            assert params[option.name].kind is inspect.Parameter.KEYWORD_ONLY
        else:
            assert option.name not in params
    assert set(params) - set(JOB_OPTIONS.names) == {"self", "command", "deferrable", "retry_policy", "aws_conn_id",
                                                    "kwargs"}
    # the templated arguments, as DAGs rely on them (a UI param in any of these renders)
    assert set(Op.template_fields) == {
        "command", "nodes", "procs_per_node", "backend", "backend_options", "distribution", "env", "deepspeed_config",
        "run_dir", "max_restarts", "mpi_options", "hang_timeout", "model_parallel_size", "pipeline_parallel_size"}
    op = Op(task_id="t", command=["train.py"])
    for option in JOB_OPTIONS:
        if option.operator:
            expected = {} if option.name in ("env", "backend_options") else option.keyword_default
            assert getattr(op, option.name) == expected, option.name


def test_airflow_default_args_and_mapping_reach_the_job_options_and_unknown_keywords_are_refused():
    """Airflow fills an operator's arguments from ``default_args`` by its signature: the job options are in it."""
    from airflow.sdk import DAG

    from dtrain.launch.airflow.operator import DistributedTrainingOperator as Op

    with DAG("options_default_args", schedule=None, default_args={"hang_timeout": 60, "stop_grace": 5}):
        op = Op(task_id="t", command=["train.py"], stop_grace=7)
    assert op.hang_timeout == 60 and op.stop_grace == 7
    with pytest.raises(Exception, match="Invalid arguments were passed to DistributedTrainingOperator"):
        Op(task_id="u", command=["train.py"], hang_timout=60)
    with DAG("options_mapped", schedule=None):  # dynamic task mapping checks its keywords against the signature too
        mapped = Op.partial(task_id="m", command=["train.py"], hang_timeout=60).expand(nodes=[1, 2])
        assert mapped.expand_input.value == {"nodes": [1, 2]} and mapped.partial_kwargs["hang_timeout"] == 60
        with pytest.raises(TypeError, match="unexpected keyword argument 'nodez'"):
            Op.partial(task_id="n", command=["train.py"]).expand(nodez=[1, 2])


@pytest.mark.parametrize("name, value, allowed", [
    ("procs_per_node", 0, "must be at least 1"), ("rdzv_port", 70000, "must be at most 65535"),
    ("hang_timeout", "nan", "a finite number between 1 and 604800"), ("device", "tpu", "one of auto, cpu, gpu"),
    ("pass_local_rank", "yes", "true or false"), ("job_id", "a b", "letters, digits"),
])
def test_the_tables_checks_name_the_field_the_value_and_what_is_allowed(name, value, allowed):
    with pytest.raises(SpecError) as e:
        JOB_OPTIONS.check(name, value)
    assert e.value.field == name and allowed in str(e.value)


def test_a_new_option_is_one_line_in_the_table():
    """The option added to the table alone is a flag, an operator keyword (Airflow's default_args reach it), a
    template field, checked with a message naming it, and a row of the docs' table."""
    from airflow.sdk import DAG, BaseOperator

    table = JOB_OPTIONS.plus(WARMUP)
    parser = argparse.ArgumentParser()
    table.add_arguments(parser, context={"backends": "local"})
    assert table.from_args(parser.parse_args(["--warmup-steps", "7"]))["warmup_steps"] == 7
    assert "--warmup-steps" in parser.format_help() and WARMUP.help in " ".join(parser.format_help().split())
    assert table.from_args(parser.parse_args([]))["warmup_steps"] == 3

    class TrainOp(BaseOperator):
        template_fields = ("command", *table.templated)

        @table.keywords
        def __init__(self, *, command, **kwargs):
            values = table.operator_values(kwargs)
            super().__init__(**kwargs)
            self.command = command
            for name, value in values.items():
                setattr(self, name, value)

    assert "warmup_steps" in TrainOp.template_fields
    assert inspect.signature(TrainOp.__init__).parameters["warmup_steps"].default == 3
    with DAG("options_new_option", schedule=None, default_args={"warmup_steps": 11}):
        assert TrainOp(task_id="a", command=["x"]).warmup_steps == 11
        assert TrainOp(task_id="b", command=["x"], warmup_steps="{{ params.w }}").warmup_steps == "{{ params.w }}"
    with pytest.raises(SpecError) as e:
        table.check("warmup_steps", "2000")
    assert (e.value.field, e.value.value) == ("warmup_steps", 2000) and "must be at most 1000" in str(e.value)
    assert table.check("warmup_steps", "12") == 12
    row = table.markdown({"backends": "local"}).splitlines()[-1]
    assert row == "| `warmup_steps` | int | `3` | yes | `--warmup-steps` | " + WARMUP.help + " |"


def test_a_new_option_is_a_keyword_only_field_of_a_dataclass_made_from_the_table():
    """As the launch spec is made (``JOB_OPTIONS.fields``): the option added to the table alone is a field
    with its default; the placement's options stay arguments of ``__post_init__`` (InitVar); a mutable
    default is a copy per instance; only what the class declares itself may be positional."""
    table = JOB_OPTIONS.plus(WARMUP)

    @dataclasses.dataclass
    @table.fields(init_only=("nodes", "backend_options"))
    class Spec:
        command: list
        note: str = "own"

        def __post_init__(self, nodes, backend_options):
            self.seen = (nodes, dict(backend_options))

    spec = Spec(["train.py"], warmup_steps=5)
    assert (spec.warmup_steps, spec.note, spec.seen) == (5, "own", (1, {}))
    assert Spec(["x"]).warmup_steps == 3 and Spec(["x"]).env == {} and Spec(["x"]).env is not Spec(["x"]).env
    names = [f.name for f in dataclasses.fields(Spec)]
    assert names[0] == "command" and names[-1] == "note" and "warmup_steps" in names and "nodes" not in names
    params = inspect.signature(Spec.__init__).parameters
    assert params["warmup_steps"].kind is inspect.Parameter.KEYWORD_ONLY and params["warmup_steps"].default == 3
    with pytest.raises(TypeError):
        Spec(["x"], "own", 2)  # an option is never positional
    with pytest.raises(TypeError, match="declared by its options table"):
        table.fields()(type("Twice", (), {"__annotations__": {"warmup_steps": int}}))


def test_a_table_refuses_an_option_declared_twice():
    with pytest.raises(ValueError, match="'warmup_steps' declared twice"):
        Options([WARMUP, WARMUP])


def test_the_docs_tables_are_what_the_tables_generate():
    from dtrain.launch.engine import options_doc

    with open(DOC, encoding="utf-8") as fh:
        text = fh.read()
    assert "<!-- options: job -->" in text
    assert options_doc.render(text) == text, "run: python -m dtrain.launch.engine.options_doc docs/backends.md"
    assert "python -m dtrain.launch.engine.options_doc docs/backends.md" in text  # the doc says how
    stale = text.replace("| `rdzv_port` | int | `0`", "| `rdzv_port` | int | `1`")
    assert options_doc.render(stale) == text  # a stale row is regenerated, so the comparison can fail


# -- the ssh backend's table ---------------------------------------------------------------------------

def test_the_ssh_settings_are_the_ssh_tables_options():
    from dtrain.launch.backends import get_backend_class
    from dtrain.launch.backends.ssh.hostfile import SSH_OPTIONS, SSHSettings

    settings = {f.name: f.default for f in dataclasses.fields(SSHSettings)}
    assert settings == {o.name: o.default for o in SSH_OPTIONS if o.name not in ("hostfile", "hosts", "conn_id")}
    assert get_backend_class("ssh").option_names == SSH_OPTIONS.names


def test_the_ssh_flags_are_the_ssh_tables():
    from dtrain.launch.backends import get_backend_class

    ssh = get_backend_class("ssh")
    args = parse_launch("--backend", "ssh", "--hostfile", "h.txt", "--ssh-port", "2222", "--ssh-key", "k",
                        "--ssh-strict-host-key-checking", "no", "--ssh-poll-interval", "1.5")
    assert ssh.options_from_cli(args) == {"hostfile": "h.txt", "port": 2222, "key_file": "k",
                                          "strict_host_key_checking": "no", "poll_interval": 1.5}
    assert ssh.options_from_cli(parse_launch()) == {}  # an unset flag is no option: the defaults apply later


def test_the_ssh_checks_name_the_option_as_ssh_dot_name():
    """Every check of the table (tests/launch/backends/ssh/test_hostfile.py has the others) names the option ssh.NAME."""
    from dtrain.launch.backends.ssh.hostfile import SSHSettings

    with pytest.raises(SpecError) as e:
        SSHSettings.from_mapping({"connect_timeout": "soon"})
    assert (e.value.field, e.value.value) == ("ssh.connect_timeout", "soon") and "integer" in e.value.allowed
    with pytest.raises(SpecError) as e:
        SSHSettings.from_mapping({"prot": 22})
    assert (e.value.field, e.value.value) == ("ssh", "prot") and e.value.allowed.startswith("one of user, port, ")


def test_a_new_ssh_option_is_one_line_in_its_table():
    from dtrain.launch.backends.ssh.hostfile import SSH_OPTIONS

    table = SSH_OPTIONS.plus(Option("compression", str, None, "ssh -C level", choices=("yes", "no"),
                                    flag="--ssh-compression"))
    parser = argparse.ArgumentParser()
    table.add_arguments(parser, defaults=False)
    assert "ssh backend (--backend ssh)" in parser.format_help() and "--ssh-compression" in parser.format_help()
    assert table.from_args(parser.parse_args(["--ssh-compression", "yes"]))["compression"] == "yes"
    with pytest.raises(SpecError) as e:
        table.check("compression", "Maybe")
    assert (e.value.field, e.value.value, e.value.allowed) == ("ssh.compression", "maybe", "one of yes, no")
    assert "| `compression` | str: yes, no | `None` | `--ssh-compression` | ssh -C level |" in table.markdown()


# -- the slurm backend's table -------------------------------------------------------------------------

def test_the_slurm_options_are_the_slurm_tables():
    from dtrain.launch.backends import get_backend_class
    from dtrain.launch.backends.slurm.render import SLURM_OPTIONS, SlurmOptions

    fields = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
              for f in dataclasses.fields(SlurmOptions)}
    assert fields == SLURM_OPTIONS.defaults()
    assert get_backend_class("slurm").option_names == SLURM_OPTIONS.names
    with open(os.path.join(REPO, "docs", "backends.md"), encoding="utf-8") as fh:
        assert "<!-- options: slurm -->" in fh.read()


def test_the_slurm_flags_and_checks_are_the_slurm_tables():
    from dtrain.launch.backends import get_backend_class
    from dtrain.launch.backends.slurm.render import SLURM_OPTIONS, SlurmOptions

    slurm = get_backend_class("slurm")
    args = parse_launch("--backend", "slurm", "--partition", "gpu", "--time", "1:00:00", "--sbatch-option=--qos=high",
                        "--sbatch-option=--exclusive", "--slurm-lost-after", "12")
    assert slurm.options_from_cli(args) == {"partition": "gpu", "time_limit": "1:00:00",
                                            "extra_sbatch": ["--qos=high", "--exclusive"], "lost_after": 12.0}
    assert slurm.options_from_cli(parse_launch()) == {}  # an unset flag is no option: the defaults apply later
    assert SlurmOptions(master_port="8").master_port == SLURM_OPTIONS.check("master_port", "8") == 8
    with pytest.raises(SpecError) as e:
        SlurmOptions(master_port=70000)
    assert (e.value.field, e.value.value) == ("master_port", 70000) and "65535" in e.value.allowed
    with pytest.raises(SpecError) as e:
        SlurmOptions(poll_interval="soon")
    assert (e.value.field, e.value.value, e.value.allowed) == ("poll_interval", "soon", "a number of seconds")
