"""What "a backend works" means: one suite every backend runs by subclassing (fsspec's
``tests/abstract`` style). A subclass sets ``backend``, ``nodes``, ``procs_per_node``,
provides the ``infra`` fixture (the real daemons it needs) and ``options(infra)`` (its
``backend_options``); everything else is the contract:

* every rank sees the env contract, and a hostile argv arrives verbatim and inert;
* a failing rank gives its exit code, and no process of the job survives on any host;
* stop (``Launcher.terminate``, what ``on_kill`` and SIGTERM call) leaves no process;
* every rank gets the same node environment (``Backend.node_env``: stop grace, node index, socket
  interface, the TF cluster where the backend serves distribution=tensorflow);
* a dry run is deterministic and starts and writes nothing;
* where the backend supports detached jobs: submit, serialize the handle, rebuild it in a
  fresh backend (and in the deferrable trigger), poll to the end, cancel -> nothing left;
  elsewhere deferral is refused before anything starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest

from dtrain.errors import SpecError
from dtrain.launch.backends import JobHandle, backend_for
from dtrain.launch.core.job import free_port, prepare_job
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.engine.launcher import Launcher
from tests.remote_jobs import job_processes, still_alive
from tests.support import alive, poll_until, rank_records, wait_for

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "contract_rank.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HOSTILE = ["$(touch {p})", "`touch {p}`", "'; touch {p}; echo '", "a b\n c", "--", "-x"]


def ranks(out_dir) -> dict[int, dict]:
    return rank_records(out_dir)


class BackendContract:
    backend = ""
    nodes = 2
    procs_per_node = 2
    #: seconds a job may take to come up on this backend (Slurm schedules, ssh logs in)
    start_timeout = 90.0

    @pytest.fixture
    def infra(self):
        yield None

    def options(self, infra) -> dict:
        return {}

    def extra_spec(self) -> dict:
        return {}

    def expected_ifname(self, infra, node_index: int) -> str:
        """The interface node ``node_index`` reaches MASTER_ADDR through (every node is this host: ``lo``)."""
        return "lo"

    def spec(self, infra, tmp_path, *args: str, env: dict | None = None, **kwargs) -> LaunchSpec:
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        fields = dict(command=[SCRIPT, *args], nodes=self.nodes, procs_per_node=self.procs_per_node,
                      backend=self.backend, device="cpu", workdir=REPO, run_dir=str(tmp_path / "run"),
                      env={"OUT_DIR": str(out), **(env or {})}, backend_options=self.options(infra))
        return LaunchSpec(**{**fields, **self.extra_spec(), **kwargs})

    def assert_nothing_left(self, infra, job_id: str) -> None:
        left = poll_until(lambda: not still_alive(job_processes(job_id)), 30) or still_alive(job_processes(job_id))
        assert left is True, f"processes of job {job_id} still running: {left}"

    def run_to_success(self, spec: LaunchSpec, tmp_path) -> tuple:
        """Run ``spec``; its result, every rank's record (all ranks there) and the world size."""
        lines: list[str] = []
        result = Launcher(spec, sink=lines.append).run()
        assert result.exit_code == 0, "\n".join(lines[-40:])
        got = ranks(tmp_path / "out")
        world = self.nodes * self.procs_per_node
        assert sorted(got) == list(range(world))
        return result, got, world

    # -- the contract -------------------------------------------------------------------------

    def test_env_contract_and_hostile_argv_on_every_rank(self, infra, tmp_path):
        pwned = tmp_path / "pwned"
        hostile = [a.format(p=pwned) for a in HOSTILE]
        result, got, world = self.run_to_success(self.spec(infra, tmp_path, *hostile), tmp_path)
        masters = set()
        for rank, record in got.items():
            env = record["env"]
            assert env["WORLD_SIZE"] == str(world) and env["RANK"] == str(rank)
            assert env["LOCAL_WORLD_SIZE"] == str(self.procs_per_node)
            assert int(env["LOCAL_RANK"]) == rank % self.procs_per_node
            assert int(env["NODE_RANK"]) == rank // self.procs_per_node
            assert env["DTRAIN_JOB_ID"] == result.job_id and env["DTRAIN_RUN_DIR"] == result.run_dir
            masters.add((env["MASTER_ADDR"], env["MASTER_PORT"]))
            assert record["argv"] == hostile  # verbatim
        assert len(masters) == 1 and all(masters.pop())  # one rendezvous, set
        assert not pwned.exists()  # and inert
        self.assert_nothing_left(infra, result.job_id)

    def test_every_rank_gets_the_node_env_of_the_contract(self, infra, tmp_path):
        """The same node environment on every backend: what a stop gives the ranks, which node each
        runs on, the socket interface each node chose (the user's choice kept), the job's own variables,
        and TF_CONFIG wherever the backend serves tensorflow."""
        user = {"NCCL_SOCKET_IFNAME": "ib9"}  # set by the user: kept; GLOO_SOCKET_IFNAME is left to each node
        spec = self.spec(infra, tmp_path, stop_grace=4.5, env=user)
        tensorflow = spec.distribution == "pytorch" and "tensorflow" in backend_for(spec).distributions
        if tensorflow:
            spec = self.spec(infra, tmp_path, stop_grace=4.5, env=user, distribution="tensorflow")
        result, got, world = self.run_to_success(spec, tmp_path)
        by_node: dict[str, set[str]] = {}
        for rank, record in got.items():
            env = record["env"]
            assert (env["DTRAIN_STOP_GRACE"], env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) == ("4.5", "5"), (rank, env)
            expected = self.expected_ifname(infra, int(env["NODE_RANK"]))
            assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == (expected, "ib9"), (rank, env)
            assert (env["DTRAIN_DISTRIBUTION"], env["DTRAIN_DEVICE"], env["PYTHONUNBUFFERED"]) == (
                spec.distribution, "cpu", "1")
            by_node.setdefault(env["DTRAIN_NODE_INDEX"], set()).add(env["NODE_RANK"])
            if tensorflow:
                config = json.loads(env["TF_CONFIG"])
                assert config["task"] == {"type": "worker", "index": rank}
                assert len(config["cluster"]["worker"]) == world and "ps" not in config["cluster"]
            else:
                assert env["TF_CONFIG"] is None
        # every node index once per node, each node's ranks on one node of the rendezvous
        assert sorted(by_node) == [str(i) for i in range(self.nodes)]
        assert all(len(node_ranks) == 1 for node_ranks in by_node.values()), by_node
        assert len(set().union(*by_node.values())) == self.nodes
        self.assert_nothing_left(infra, result.job_id)

    def test_failing_rank_gives_its_exit_code_and_leaves_no_process(self, infra, tmp_path):
        last = self.nodes * self.procs_per_node - 1
        spec = self.spec(infra, tmp_path, "--fail", str(last), "7", "--hang")
        lines: list[str] = []
        result = Launcher(spec, sink=lines.append).run()
        assert result.exit_code == 7 and result.failed_rank == last, "\n".join(lines[-40:])
        assert any("failing on purpose" in line for line in result.tail)
        self.assert_nothing_left(infra, result.job_id)

    def test_a_child_that_left_the_session_dies_with_the_job(self, infra, tmp_path):
        """A rank's ``setsid`` child outlives the rank (re-parented to init): teardown still finds
        it by the job id in its environment, on every host."""
        spec = self.spec(infra, tmp_path, "--escape")
        lines: list[str] = []
        result = Launcher(spec, sink=lines.append).run()
        assert result.exit_code == 0, "\n".join(lines[-40:])
        out = tmp_path / "out"
        escaped = [int((out / name).read_text()) for name in os.listdir(out) if name.startswith("escaped")]
        assert len(escaped) == self.nodes * self.procs_per_node
        assert poll_until(lambda: alive(escaped) == [], 30), f"escaped children still running: {alive(escaped)}"
        self.assert_nothing_left(infra, result.job_id)

    def test_stop_leaves_no_process(self, infra, tmp_path):
        spec = self.spec(infra, tmp_path, "--hang")
        lines: list[str] = []
        launcher = Launcher(spec, sink=lines.append)
        results = []
        thread = threading.Thread(target=lambda: results.append(launcher.run()))
        thread.start()
        try:
            world = self.nodes * self.procs_per_node
            wait_for(lambda: len(ranks(tmp_path / "out")) == world, self.start_timeout, what="every rank up")
        finally:
            launcher.terminate()  # what on_kill and SIGTERM call
            thread.join(timeout=120)
        assert not thread.is_alive()
        assert results[0].stopped and results[0].exit_code == 143
        self.assert_nothing_left(infra, results[0].job_id)
        assert alive([r["pid"] for r in ranks(tmp_path / "out").values()]) == []

    def test_dryrun_is_exact_and_has_no_side_effects(self, infra, tmp_path):
        spec = self.spec(infra, tmp_path, "train", "$(id)", rdzv_port=free_port(), job_id="dtrain-contract")
        backend = backend_for(spec)(sink=lambda line: None)
        first = backend.dryrun(prepare_job(spec, create=False))
        again = backend.dryrun(prepare_job(spec, create=False))
        assert first == again  # every choice made the same way: what submit would run
        assert first.argvs and all(first.argvs) and first.render()
        assert not (tmp_path / "run").exists()  # nothing written
        assert job_processes("dtrain-contract") == []  # nothing started

    def test_detached_submit_poll_cancel_round_trip(self, infra, tmp_path):
        spec = self.spec(infra, tmp_path, "--hang")
        cls = backend_for(spec)
        if not cls.supports_detached:
            with pytest.raises(SpecError, match="deferrable"):
                cls(sink=lambda line: None).submit(prepare_job(spec), detached=True)
            assert job_processes(spec.run_dir) == []
            return
        handle = cls(sink=lambda line: None).submit(prepare_job(spec), detached=True)
        try:
            data = json.loads(json.dumps(handle.to_dict()))  # primitives only
            rebuilt = JobHandle.from_dict(data)
            assert rebuilt == handle
            fresh = cls(sink=lambda line: None)  # another process would start from the handle alone
            world = self.nodes * self.procs_per_node
            wait_for(lambda: len(ranks(tmp_path / "out")) == world, self.start_timeout, what="every rank up")
            status = fresh.poll(rebuilt)
            assert not status.done and status.reachable
            assert not asyncio.run(fresh.async_poll(rebuilt)).done
            assert isinstance(fresh.logs(rebuilt), list)
        finally:
            cls(sink=lambda line: None).cancel(JobHandle.from_dict(handle.to_dict()))
        self.assert_nothing_left(infra, handle.job_id)
        final = wait_for(lambda: (s := cls(sink=lambda line: None).poll(handle)).done and s, 60, what="a final status")
        assert not final.ok

    def test_detached_job_runs_to_success_through_the_trigger(self, infra, tmp_path):
        spec = self.spec(infra, tmp_path)
        cls = backend_for(spec)
        if not cls.supports_detached:
            pytest.skip(f"{cls.name} jobs do not outlive their submitter")
        import importlib

        from dtrain.launch.airflow.deferrable import resume_job, write_submission
        from dtrain.launch.airflow.trigger import DistributedJobTrigger

        handle = cls(sink=lambda line: None).submit(prepare_job(spec), detached=True)
        write_submission(handle)
        classpath, kwargs = DistributedJobTrigger(handle=handle.to_dict(), poll_interval=0.2).serialize()
        module, _, name = classpath.rpartition(".")
        trigger = getattr(importlib.import_module(module), name)(**json.loads(json.dumps(kwargs)))

        async def first_event():
            async for event in trigger.run():
                return event.payload

        try:
            event = asyncio.run(asyncio.wait_for(first_event(), self.start_timeout + 60))
        finally:
            cls(sink=lambda line: None).cancel(handle)
        assert event["status"] == "success", event
        result = resume_job(None, event)
        assert result["exit_code"] == 0 and result["world_size"] == self.nodes * self.procs_per_node
        assert sorted(ranks(tmp_path / "out")) == list(range(self.nodes * self.procs_per_node))
        self.assert_nothing_left(infra, handle.job_id)
