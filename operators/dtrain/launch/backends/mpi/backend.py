"""The mpi backend: one ``mpirun`` starts every rank, on this host or on another backend's nodes.

``backend="mpi"`` runs mpirun on this host; the local and ssh backends hand
``distribution="mpi"`` here (their ``runner``). The nodes come from the named backend's
:meth:`~dtrain.launch.backends.base.Backend.node_access` (through the registry, never by
importing it): for ssh hosts mpirun reaches them with ``ssh -F <run_dir>/mpi/ssh_config``,
a generated config with one alias per host (``dtrain-node0``...) carrying its address,
port, user, key and host-key policy, so per-host ports and users work, and node order =
hostfile order.

MASTER_ADDR (first node) and MASTER_PORT (free there) are exported to every rank with
``-x NAME``, as are the job's variables; values stay out of argv.

Teardown: SIGTERM to mpirun first (it stops the ranks on every host through its daemons),
then the supervisor's process-tree teardown after the grace period. A killed mpirun also
stops the remote ranks: each orted exits when it loses mpirun.

A lost node (mpirun over ssh): mpirun's nodes have no agent of ours, so each node's local rank 0
holds the node's lease (:mod:`dtrain.launch.node.lease`, its peer the next node's login port; the
launcher exports the endpoints and ``lost_after``): a node cut off from its peer fences itself,
and every node beats in ``lease/<job id>/``. Each poll reads the leases (once a second) and, on a
sign (a fence, a stale beat, or mpirun failing), probes every node's login port
(:func:`dtrain.launch.core.lost.lost_by_leases`): the job then ends with the lost-node verdict,
not with mpirun's own account of a lost daemon (or none: a partitioned node's orted can keep its
ranks waiting for minutes).

mpirun can hang in its own teardown after every rank ended (races in OpenMPI's runtime at
finalize: open-mpi/ompi#4726, #7790). Every rank's wrapper writes an exit record as it ends,
so once each rank has one and mpirun still runs ``linger_seconds`` later, the job is over: its
outcome is the records', and mpirun, its ssh sessions and daemons are torn down.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

from dtrain.errors import LaunchError, SpecError
from dtrain.launch.backends import get_backend_class
from dtrain.launch.backends.base import Backend, DryRunRequest, JobHandle, JobStatus, NodeAccess
from dtrain.launch.backends.mpi.render import check_export_names, coerce_mpi_options, mpirun_argv, mpirun_env
from dtrain.launch.core.exits import exit_records, first_failure_of, ranks_exited_since, records_since
from dtrain.launch.core.job import Job
from dtrain.launch.core.lost import PROBE_TIMEOUT_S, LostNode, TellOnce, fault_of, lost_by_leases
from dtrain.launch.backends.placement import Placement
from dtrain.launch.core.processes import NodeSupervisor
from dtrain.launch.core.spec import LaunchSpec
from dtrain.launch.node.lease import lease_env
from dtrain.rundir import RunDir


def mpi_hostfile_text(nodes: int, procs_per_node: int) -> str:
    """mpirun's hostfile over the ssh_config aliases, in node order."""
    return "".join(f"dtrain-node{i} slots={procs_per_node}\n" for i in range(nodes))


#: How long mpirun may outlive the last of its ranks (it normally exits within a second).
LINGER_S = 30.0
#: How often poll looks for exit records and leases (poll itself runs every 20 ms).
RECORDS_CHECK_S = 1.0
#: How often the nodes are probed while a lease shows a sign but no verdict (a stale beat of a node
#: whose local rank 0 ended first, a fence record being written)
PROBE_AGAIN_S = 5.0


def outcome_of(records: list[dict]) -> tuple[int, int | None]:
    """(exit code, node) mpirun would have ended with: the first rank that failed on its own,
    else any nonzero code (a rank stopped by a signal), else 0."""
    failure = first_failure_of(records)
    if failure is not None:
        return int(failure["exit_code"]), failure.get("node_rank")
    codes = [r.get("exit_code") for r in records if isinstance(r.get("exit_code"), int) and r.get("exit_code")]
    return (codes[0], None) if codes else (0, None)


class MPIBackend(Backend):
    """mpirun starts every rank (per-process launch); the rank wrapper maps OMPI_* to the contract."""

    name = "mpi"
    carries_secret_env = True  # mpirun's environment, forwarded by name (-x NAME)
    description = "one mpirun starts every rank (OpenMPI), on this host or the ssh hosts"
    install_hint = "apt-get install openmpi-bin"
    single_host = True  # when named itself: mpirun on this host
    #: named itself, mpirun also starts DDP/DeepSpeed/TF scripts (the wrapper maps OMPI_* to the contract)
    distributions = ("mpi", "pytorch", "deepspeed", "tensorflow")

    def __init__(self, sink=None, grace_seconds: float | None = None, mpirun: str = "mpirun",
                 linger_seconds: float = LINGER_S):
        super().__init__(**({"sink": sink} if sink else {}))
        self.grace_seconds = grace_seconds  # None: the spec's stop_grace (set at submit)
        self._grace_now = 5.0 if grace_seconds is None else grace_seconds  # the submitted job's
        self.mpirun = mpirun
        self.linger_seconds = linger_seconds
        self.supervisor = NodeSupervisor(self._mpirun_sink, grace_seconds=self._grace_now)
        self._records_before: dict[str, int] = {}
        self._records_checked = 0.0
        self._ranks_ended_at: float | None = None
        self._access: NodeAccess | None = None  # the submitted job's nodes
        self._leases_checked = self._probed = 0.0
        self._told = TellOnce(self.sink)  # suspect nodes, refused lease records: once each

    @classmethod
    def validate(cls, spec: LaunchSpec) -> None:
        spec.mpi_options = coerce_mpi_options(spec.mpi_options)
        check_export_names([*spec.env, *spec.secret_env])  # they also sit in mpirun's own environment
        placement = spec.placement
        if get_backend_class(placement.backend).single_host and placement.nodes != 1:
            raise SpecError("nodes", placement.nodes, f"1 for mpirun on this host (backend={placement.backend!r}); "
                                                      "use backend='ssh' with a hostfile for several")
        if shutil.which("mpirun") is None:
            raise SpecError("distribution", "mpi", f"OpenMPI's mpirun on PATH ({cls.install_hint})")
        remote = not get_backend_class(placement.backend).single_host
        if remote and spec.run_dir is not None and any(c.isspace() for c in str(spec.run_dir)):
            # mpirun splits its rsh agent (ssh -F <run_dir>/mpi/ssh_config) on blanks.
            raise SpecError("run_dir", spec.run_dir, "a path without blanks for mpirun over ssh")

    @classmethod
    def node_access(cls, placement: Placement) -> NodeAccess:
        """The nodes are the named backend's (this host when the placement names mpi itself)."""
        named = get_backend_class(placement.backend)
        return super().node_access(placement) if named is cls else named.node_access(placement)

    def _mpirun_sink(self, line: str) -> None:
        # The supervisor prefixes lines that are not a rank's with its node index; here the
        # one "node" is mpirun itself.
        self.sink("[mpirun] " + line[len("[node0] "):] if line.startswith("[node0] ") else line)

    def _files(self, job: Job) -> dict[str, str]:
        """The files mpirun reads (ssh_config and hostfile) when the nodes are remote: path -> text."""
        access = self.node_access(job.spec.placement)
        if access.ssh_config is None:
            return {}
        mpi_dir = os.path.join(job.run_dir, "mpi")
        if any(c.isspace() for c in mpi_dir):
            # mpirun splits plm_rsh_agent on blanks: the config path must have none.
            raise LaunchError(f"run_dir {job.run_dir!r} must not contain blanks for mpirun over ssh", 2)
        return {os.path.join(mpi_dir, "ssh_config"): access.ssh_config,
                os.path.join(mpi_dir, "hostfile"): mpi_hostfile_text(job.spec.placement.nodes,
                                                                     job.spec.placement.procs_per_node)}

    def dryrun(self, job: Job, *, detached: bool = False) -> DryRunRequest:
        if detached:
            raise SpecError("deferrable", True, "not with mpirun (it must stay attached to its ranks)")
        spec = job.spec
        access = self.node_access(spec.placement)
        port = get_backend_class(spec.placement.backend)(sink=self.sink).free_port(spec)
        files = list(self._files(job))
        master = access.addresses[0]
        # One environment for every rank: each one's node index comes from its NODE_RANK (rank wrapper).
        exported = {"MASTER_ADDR": master, "MASTER_PORT": str(port), "AZ_BATCH_MASTER_NODE": f"{master}:{port}",
                    **self.node_env(job, port=port),
                    **(lease_env(access.endpoints, access.lost_after) if access.lost_after is not None else {})}
        argv = mpirun_argv(nodes=spec.placement.nodes, procs_per_node=spec.placement.procs_per_node,
                           python=access.python,
                           command=spec.command, export=sorted(exported),
                           hostfile=files[1] if files else None,
                           rsh_agent=f"ssh -F {files[0]}" if files else None,
                           workdir=spec.workdir or os.getcwd(), user_options=spec.mpi_options, mpirun=self.mpirun)
        return DryRunRequest(backend=self.name, argvs=(tuple(argv),), env=exported)

    def submit(self, job: Job, *, detached: bool = False) -> JobHandle:
        request = self.dryrun(job, detached=detached)
        run = RunDir(job.run_dir)
        for path, text in self._files(job).items():
            run.write(*os.path.relpath(path, job.run_dir).split(os.sep), data=text.encode(), mode=0o600)
        argv = list(request.argvs[0])
        self._records_before, self._ranks_ended_at = exit_records(job.run_dir), None  # not this mpirun's ranks
        self.sink("[dtrain] mpirun: " + " ".join(argv[: argv.index("-m") - 1]))
        self.supervisor.job_id = job.job_id  # teardown also finds what left the tree
        self._access = self.node_access(job.spec.placement)
        self._grace_now = self.supervisor.grace_seconds = self.stop_grace(job.spec)
        self.supervisor.start([argv], [mpirun_env({**os.environ, **request.env})], cwd=job.spec.workdir)
        return JobHandle(backend=self.name, job_id=job.job_id, backend_job_id=job.job_id, run_dir=job.run_dir,
                         world_size=job.spec.world_size, submitted_at=time.time())

    def poll(self, handle: JobHandle) -> JobStatus:
        done, code, node = self.supervisor.check(expected=1)
        lost = self._lost_node(handle, failed=done and code != 0)
        if lost is not None:
            self.sink(f"[dtrain] {lost.message()}: stopping mpirun; a node cut off from its peer fences itself "
                      f"within {self._access.lost_after:g} s")
            return JobStatus.of_lost_node(lost, self.logs(handle))
        if not done:
            return self._outlived_ranks(handle) or JobStatus(state="RUNNING", done=False)
        return JobStatus(state="COMPLETED" if code == 0 else "FAILED", done=True, exit_code=code,
                         failed_node=None if node is None else 0, tail=[] if node is None else list(node.tail))

    def _lost_node(self, handle: JobHandle, failed: bool) -> LostNode | None:
        """The node the job lost, from the nodes' leases (at most once a second, the nodes probed at most
        every PROBE_AGAIN_S while running); always looked at once mpirun failed."""
        access, now = self._access, time.monotonic()
        if access is None or access.lost_after is None or not access.endpoints:
            return None
        if not failed and (now - self._leases_checked < RECORDS_CHECK_S or now - self._probed < PROBE_AGAIN_S):
            return None
        self._leases_checked = now

        def probe(address: str, port: int) -> tuple[str, str] | None:
            self._probed = time.monotonic()
            return fault_of(address, port, timeout=PROBE_TIMEOUT_S)

        # key None: each node's holder is a thread of its local rank 0, so a rank could sign anything it
        # could; the records are hints, which the probe of each node's sshd confirms or contradicts
        return lost_by_leases(handle.run_dir, handle.job_id, len(access.endpoints), access.lost_after,
                              failed=failed, hosts=lambda: access.endpoints, probe=probe, silent_daemon=None,
                              key=None, report=self._told)

    def _outlived_ranks(self, handle: JobHandle) -> JobStatus | None:
        """The job's end when every rank has ended and mpirun has not, ``linger_seconds`` on."""
        now = time.monotonic()
        if self._ranks_ended_at is None:
            if now - self._records_checked < RECORDS_CHECK_S:
                return None
            self._records_checked = now
            if not ranks_exited_since(self._records_before, exit_records(handle.run_dir), handle.world_size):
                return None
            self._ranks_ended_at = now
        if now - self._ranks_ended_at < self.linger_seconds:
            return None
        records = records_since(handle.run_dir, self._records_before, exit_records(handle.run_dir))
        code, node = outcome_of(records)
        self.sink(f"[dtrain] every rank ended but mpirun still runs {self.linger_seconds:g} s later (hung in its "
                  f"own teardown): the job ends with the ranks' exit code {code}; stopping mpirun")
        return JobStatus(state="COMPLETED" if code == 0 else "FAILED", done=True, exit_code=code,
                         failed_node=node, tail=self.logs(handle))

    def cancel(self, handle: JobHandle | None = None, grace: float | None = None) -> None:
        """mpirun first: it stops the ranks on every host in order, within ``grace`` (default: the spec's
        stop grace); then whatever is left, at once if mpirun had its grace and did not end (it waits on
        a daemon that cannot answer: a lost node's), else after the same grace."""
        grace = self._grace_now if grace is None else grace
        had_its_grace = False
        for node in list(self.supervisor.nodes):
            if node.proc.poll() is None:
                try:
                    node.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + grace
                while node.proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                had_its_grace = had_its_grace or node.proc.poll() is None
        self.supervisor.teardown(0.0 if had_its_grace else grace)

    def logs(self, handle: JobHandle, lines: int = 40) -> list[str]:
        return [line for node in list(self.supervisor.nodes) for line in node.tail][-lines:]

    def release(self, handle: JobHandle) -> None:
        self.supervisor.teardown()

    def terminate(self, grace: float | None = None) -> None:
        super().terminate()
        self.supervisor.stop("terminate")
        self.cancel(grace=grace)

    def pids(self) -> set[int]:
        return self.supervisor.pids()
