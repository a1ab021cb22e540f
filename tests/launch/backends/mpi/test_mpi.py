"""The backend contract on the mpi backend (mpirun starts every rank on this host), and an
mpirun that outlives its ranks."""

import pytest

from dtrain.launch.backends.mpi.backend import MPIBackend, outcome_of
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from tests.launch.backends.contract import SCRIPT, BackendContract, ranks
from tests.remote_jobs import job_processes, needs_mpirun, still_alive
from tests.support import alive, wait_for


@needs_mpirun
class TestMPIBackend(BackendContract):
    backend = "mpi"
    nodes = 1

    def extra_spec(self) -> dict:
        return {"distribution": "mpi", "mpi_options": ["--oversubscribe"]}


# Fault injection (named as such): an mpirun that hangs in its own teardown after every rank
# ended, as OpenMPI's runtime can at finalize (open-mpi/ompi#4726, #7790). The real mpirun runs
# the job; the wrapper then stays, holding mpirun's output pipe, as a hung mpirun would.
LINGERING_MPIRUN = """#!/bin/sh
echo $$ > "{pid_file}"
mpirun "$@"
code=$?
sleep 300
exit $code
"""


def fake_mpirun(tmp_path, template: str):
    """An executable ``mpirun`` wrapper from ``template`` (it writes its pid to ``{pid_file}``): (path, pid file)."""
    pid_file = tmp_path / "wrapper.pid"
    wrapper = tmp_path / "mpirun"
    wrapper.write_text(template.format(pid_file=pid_file))
    wrapper.chmod(0o755)
    return wrapper, pid_file


@needs_mpirun
@pytest.mark.parametrize("fail", [False, True], ids=["ok", "rank1-exits-3"])
def test_an_mpirun_that_outlives_its_ranks_ends_with_their_outcome_and_is_stopped(tmp_path, fail):
    wrapper, pid_file = fake_mpirun(tmp_path, LINGERING_MPIRUN)
    out = tmp_path / "out"
    out.mkdir()
    spec = LaunchSpec(command=[SCRIPT, *(["--fail", "1", "3"] if fail else [])], nodes=1, procs_per_node=2,
                      backend="mpi", distribution="mpi", device="cpu", env={"OUT_DIR": str(out)},
                      run_dir=str(tmp_path / "run"), mpi_options=["--oversubscribe"])
    lines: list[str] = []
    backend = MPIBackend(sink=lines.append, mpirun=str(wrapper), linger_seconds=1)
    result = Launcher(spec, sink=lines.append, backend=backend).run()
    log = "\n".join(lines)
    assert ("[dtrain] every rank ended but mpirun still runs 1 s later (hung in its own teardown): the job ends "
            f"with the ranks' exit code {3 if fail else 0}; stopping mpirun") in lines, log
    assert (result.exit_code, result.failed_rank) == ((3, 1) if fail else (0, None)), log
    assert sorted(ranks(out)) == [0, 1]
    assert wait_for(lambda: not alive([int(pid_file.read_text())]), 10)
    assert wait_for(lambda: not still_alive(job_processes(result.job_id)), 10)


def test_outcome_of_the_records_is_the_first_rank_that_failed_on_its_own():
    records = [{"rank": 0, "node_rank": 0, "exit_code": 143, "stopped_by_signal": 15, "time": 5.0},
               {"rank": 3, "node_rank": 1, "exit_code": 3, "stopped_by_signal": None, "time": 7.0},
               {"rank": 2, "node_rank": 1, "exit_code": 4, "stopped_by_signal": None, "time": 6.0}]
    assert outcome_of(records) == (4, 1)
    assert outcome_of(records[:1]) == (143, None)  # only stopped ranks: still a failure
    assert outcome_of([{"rank": 0, "exit_code": 0, "time": 1.0}]) == (0, None)
    assert outcome_of([]) == (0, None)


@needs_mpirun
def test_mpirun_over_ssh_asks_every_node_for_a_lease_on_the_hosts_login_ports(tmp_path):
    """Each node's local rank 0 holds the node's lease (dtrain.launch.node.lease.start_from_env): the launcher
    exports every node's login endpoint, in node order, and lost_after; on this host there is none."""
    from dtrain.launch.core.job import prepare_job
    from dtrain.launch.node.lease import LEASE_ENV, PEERS_ENV

    spec = LaunchSpec(command=[SCRIPT], nodes=3, procs_per_node=1, backend="ssh", distribution="mpi",
                      device="cpu", run_dir=str(tmp_path / "run"), rdzv_port=29500,
                      backend_options={"hosts": ["10.0.0.1", "bob@10.0.0.2:2222", "[fd00::3]"], "port": 2200,
                                       "lost_after": 20})
    request = MPIBackend().dryrun(prepare_job(spec, create=False))
    assert {k: v for k, v in request.env.items() if k.startswith("DTRAIN_LEASE")} == {
        LEASE_ENV: "20", PEERS_ENV: "10.0.0.1:2200,10.0.0.2:2222,[fd00::3]:2200"}
    argv = request.argvs[0]
    exported = {argv[i + 1] for i, token in enumerate(argv) if token == "-x"}
    assert {LEASE_ENV, PEERS_ENV} <= exported and "20" not in argv  # by name: values stay out of argv
    here = LaunchSpec(command=[SCRIPT], nodes=1, procs_per_node=2, backend="mpi", distribution="mpi",
                      device="cpu", run_dir=str(tmp_path / "here"))
    assert not any(k.startswith("DTRAIN_LEASE") for k in MPIBackend().dryrun(prepare_job(here, create=False)).env)


# Fault injection (named as such): an mpirun that does not end on SIGTERM, as a real one waiting on the
# daemon of a lost node (frozen or cut off) does not.
DEAF_MPIRUN = """#!/bin/sh
trap '' TERM
echo $$ > "{pid_file}"
mpirun "$@"
sleep 300
"""


@needs_mpirun
def test_a_cancel_gives_mpirun_the_grace_it_is_given_once_then_stops_what_is_left(tmp_path):
    """A job that lost a node is cancelled with a short grace (the reachable ranks cannot checkpoint
    without it): an mpirun that does not end within it is stopped then, not after the spec's stop grace
    again (that made a frozen node's launch end 30 s after its verdict)."""
    import threading
    import time

    from dtrain.launch.core.job import prepare_job

    wrapper, pid_file = fake_mpirun(tmp_path, DEAF_MPIRUN)
    spec = LaunchSpec(command=[SCRIPT], nodes=1, procs_per_node=1, backend="mpi", distribution="mpi", device="cpu",
                      run_dir=str(tmp_path / "run"), env={"OUT_DIR": str(tmp_path)}, stop_grace=120,
                      mpi_options=["--oversubscribe"])
    backend = MPIBackend(sink=lambda line: None, mpirun=str(wrapper))
    handle = backend.submit(prepare_job(spec))
    try:
        assert wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 30)
        cancel = threading.Thread(target=backend.cancel, args=(handle, 1.0), daemon=True)
        cancel.start()
        cancel.join(60)  # the spec's stop grace is 120 s: waiting it out would still be running
        assert not cancel.is_alive()
        assert not alive([int(pid_file.read_text())])
    finally:
        backend.release(handle)
