"""Airflow as production runs it, for end-to-end tests: PostgreSQL for its metadata, the CeleryExecutor
with Redis as its broker, and each component on a machine of its own (tests/netcluster.py's hosts).

=========  =============================================  ====================================
host       runs                                           reached at
=========  =============================================  ====================================
this one   PostgreSQL, Redis, moto's S3, the test         the bridge's address (``gateway``)
0          api-server (port 8080), scheduler,             ``api_host.address``
           dag-processor
1, 2       a Celery worker each (``worker-1``,            their own addresses
           ``worker-2``; 2 task slots each)
3          the triggerer
4, 5, ...  an sshd each (``training_hosts``): the ssh        their own addresses
           jobs' nodes
=========  =============================================  ====================================

The hosts share this machine's filesystem, so AIRFLOW_HOME (its logs), the DAG bundles and the shared
filesystem of the training jobs are shared as a cluster's shared filesystem would be. Each host has its
own loopback: everything a component reaches goes to an address on the bridge, as on real machines.
A task instance's ``hostname`` is its worker's address (:mod:`tests.deployment_host`; the hosts
share this machine's hostname).

:class:`Postgres` and :class:`Redis` are Debian's servers (scripts/apt-packages.txt), started in a
temporary directory and stopped with the deployment; nothing of them outlives it.
"""

from __future__ import annotations

import base64
import contextlib
import glob
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from typing import Iterator

from tests.airflow_services import REPO, AirflowServices
from tests.netcluster import Host, NetCluster
from tests.services import free_port, moto_server
from tests.support import wait_for

API_PORT = 8080  # every host has its own ports: the api-server takes Airflow's default on its host
WORKERS = ("worker-1", "worker-2")
#: task slots per Celery worker (Airflow's default, 16, would fork 16 pool processes on each host)
WORKER_CONCURRENCY = 2
#: the user PostgreSQL's cluster is made for (``initdb -U``), trusted from the bridge's subnet
DB_USER = "airflow"


def postgres_bin() -> str:
    """Debian's PostgreSQL binaries, the newest installed (``postgresql`` in scripts/apt-packages.txt)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise FileNotFoundError("PostgreSQL is not installed: apt-get install postgresql (scripts/bootstrap.sh does)")
    return os.path.dirname(found[-1])


def _started(server, what: str, timeout: float, interval: float):
    """``server`` once its ``_ready()`` is true; stopped, and the error raised, if it never is."""
    try:
        wait_for(server._ready, timeout, interval=interval, what=what)
    except BaseException:
        server.stop()
        raise
    return server


class Postgres:
    """A PostgreSQL cluster of its own in a temporary directory, listening on ``address`` only, trusting
    every connection from ``subnet`` (the test cluster's bridge). PostgreSQL refuses to run as root: it runs
    as the ``postgres`` user Debian's package makes, so its directory is not under pytest's (0700) tmp."""

    def __init__(self, address: str, subnet: str):
        self.address, self.subnet = address, subnet
        self.port = free_port()
        self.dir = ""
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Postgres":
        bindir = postgres_bin()
        self.dir = tempfile.mkdtemp(prefix="dtrain-pg-")
        os.chmod(self.dir, 0o755)
        shutil.chown(self.dir, "postgres", "postgres")
        data = os.path.join(self.dir, "data")
        as_postgres = {"user": "postgres", "group": "postgres", "extra_groups": [], "cwd": self.dir}
        subprocess.run([os.path.join(bindir, "initdb"), "-D", data, "-U", DB_USER, "--auth=trust", "-E", "UTF8",
                        "--no-sync"], check=True, capture_output=True, timeout=120, **as_postgres)
        with open(os.path.join(data, "pg_hba.conf"), "a", encoding="utf-8") as fh:
            fh.write(f"host all all {self.subnet} trust\n")
        log = open(os.path.join(self.dir, "postgres.log"), "ab")
        # Durability off (fsync, synchronous commits, full pages): a test database is thrown away; the
        # metadata traffic is then CPU-bound, as on a production server's battery-backed disks.
        self.proc = subprocess.Popen(
            [os.path.join(bindir, "postgres"), "-D", data, "-c", f"listen_addresses={self.address}",
             "-c", f"port={self.port}", "-c", f"unix_socket_directories={self.dir}", "-c", "fsync=off",
             "-c", "synchronous_commit=off", "-c", "full_page_writes=off", "-c", "max_connections=200"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **as_postgres)
        log.close()
        return _started(self, "PostgreSQL to accept connections", 60, interval=0.2)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, f"postgres exited: {self.log()[-2000:]}"
        return subprocess.run([os.path.join(postgres_bin(), "pg_isready"), "-q", "-h", self.address, "-p",
                               str(self.port)], timeout=30).returncode == 0

    def create_database(self, name: str) -> str:
        """A new empty database; returns its SQLAlchemy URL (psycopg2, the driver Airflow documents)."""
        subprocess.run([os.path.join(postgres_bin(), "psql"), "-q", "-h", self.address, "-p", str(self.port), "-U",
                        DB_USER, "-d", "postgres", "-c", f'CREATE DATABASE "{name}"'], check=True, capture_output=True,
                       timeout=60)
        return f"postgresql+psycopg2://{DB_USER}@{self.address}:{self.port}/{name}"

    def log(self) -> str:
        path = os.path.join(self.dir, "postgres.log")
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    def stop(self) -> None:
        """Fast shutdown (SIGINT: connections are closed, no waiting for clients), then the directory."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the postmaster and its backends: one session
                self.proc.wait(timeout=30)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


class Redis:
    """redis-server on ``address``, in memory only (no snapshot, no append-only file)."""

    def __init__(self, address: str, directory: str):
        self.address, self.dir = address, directory
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Redis":
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        log = open(os.path.join(self.dir, "redis.log"), "ab")
        self.proc = subprocess.Popen([binary, "--bind", self.address, "--port", str(self.port), "--save", "",
                                      "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return _started(self, "Redis to accept connections", 30, interval=0.1)

    def _ready(self) -> bool:
        import socket

        assert self.proc.poll() is None, "redis-server exited (see redis.log)"
        try:
            with socket.create_connection((self.address, self.port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    @property
    def url(self) -> str:
        return f"redis://{self.address}:{self.port}/0"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def fernet_key() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()


class CeleryDeployment(AirflowServices):
    """Airflow's components on the hosts of ``net`` (the table above), on ``db_url`` and ``broker_url``."""

    sqlite = False
    s3_endpoint = ""  # its tasks' S3 server (celery_deployment)
    training = None  # the sshd hosts its ssh jobs run on (celery_deployment's training_hosts), or None

    def __init__(self, home: str, env: dict[str, str], dags_folder: str, bundles: list[dict], *, net: NetCluster,
                 db_url: str, broker_url: str):
        super().__init__(home, env, dags_folder, bundles)
        self.net = net
        api = net.hosts[0].address
        self.port = API_PORT
        self.base_url = f"http://{api}:{API_PORT}"
        self.url = f"{self.base_url}/api/v2"
        for name in ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC"):
            self.env.pop(name)  # SQLite's busy timeout (dtrain.pipeline.sqlite): psycopg2 refuses the option
        self.env.update(
            AIRFLOW__CORE__EXECUTOR="CeleryExecutor",
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=db_url,
            AIRFLOW__CELERY__BROKER_URL=broker_url,
            AIRFLOW__CELERY__RESULT_BACKEND="db+" + db_url,
            AIRFLOW__CELERY__WORKER_CONCURRENCY=str(WORKER_CONCURRENCY),
            AIRFLOW__API__PORT=str(API_PORT), AIRFLOW__API__BASE_URL=f"http://{api}:{API_PORT}",
            AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://{api}:{API_PORT}/execution/",
            # Every component signs and reads the same tokens and secrets, as a deployment's secret
            # store hands them out (else each host's first `airflow` command writes its own).
            AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_urlsafe(32), AIRFLOW__CORE__FERNET_KEY=fernet_key(),
            AIRFLOW__CORE__HOSTNAME_CALLABLE="tests.deployment_host.address",
            PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p),
        )

    @property
    def api_host(self) -> Host:
        return self.net.hosts[0]

    @property
    def worker_hosts(self) -> list[Host]:
        return self.net.hosts[1:1 + len(WORKERS)]

    @property
    def triggerer_host(self) -> Host:
        return self.net.hosts[1 + len(WORKERS)]

    def spawn_on(self, host: Host, name: str, *argv: str) -> subprocess.Popen:
        """``airflow <argv>`` on ``host`` as component ``name`` (its task instances carry that host's address)."""
        env = dict(self.env, DTRAIN_TEST_HOST_ADDRESS=host.address)
        return self.spawn(name, *argv, popen=lambda cmd, **kw: host.popen(cmd, env=env, **kw))

    def start_workers(self, *indices: int, timeout: float = 180) -> None:
        """Celery workers ``indices`` (default: all) on their hosts, once each is ready for tasks (its log says
        so: a task queued before a worker listens waits for it, and tests time from ready workers)."""
        started = {}
        for index in indices or range(len(WORKERS)):
            name = WORKERS[index]
            before = self.log(name).count(f"celery@{name} ready")  # a restarted worker appends to its log
            started[name] = before, self.spawn_on(self.worker_hosts[index], name, "celery", "worker",
                                                  "--celery-hostname", name, "--concurrency", str(WORKER_CONCURRENCY))
        for name, (before, proc) in started.items():
            wait_for(lambda: self.log(name).count(f"celery@{name} ready") > before or proc.poll() is not None,
                     timeout, interval=0.5, what=f"Celery worker {name} to be ready")
            assert proc.poll() is None, f"Celery worker {name} exited:\n{self.log(name)[-3000:]}"

    def shut_down(self, name: str, grace: float = 60) -> bool:
        """Stop component ``name`` as a process supervisor stops it for an upgrade: SIGTERM to its main
        process only, then SIGKILL to it and everything it started if it has not exited after ``grace``
        seconds (systemd's KillMode=mixed, Kubernetes' terminationGracePeriodSeconds). A Celery worker's
        SIGTERM is its warm shutdown: it waits for its running tasks. Returns whether it exited in time."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
            return True
        except subprocess.TimeoutExpired:
            self.kill(name)
            return False

    def hosts_that_ran(self, dag_id: str, run_id: str) -> set[str]:
        """The addresses of the hosts where the run's finished task instances ran."""
        from urllib.parse import quote

        status, body = self.request("GET", f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances")
        assert status == 200, body
        return {ti["hostname"] for ti in body["task_instances"] if ti["state"] in ("success", "failed")}

    def start(self, dag_ids: list[str], timeout: float = 180) -> None:
        self.migrate()
        for name in ("api-server", "scheduler", "dag-processor"):
            self.spawn_on(self.api_host, name, name)
        self.spawn_on(self.triggerer_host, "triggerer", "triggerer")
        self.start_workers(timeout=timeout)
        for dag_id in dag_ids:
            self.wait_ready(dag_id, timeout)


@contextlib.contextmanager
def celery_deployment(home: str, env: dict[str, str], dags_folder: str, bundles: list[dict], dag_ids: list[str],
                      *, seed_s3=None, training_hosts: int = 0) -> Iterator[CeleryDeployment]:
    """The whole deployment (hosts, PostgreSQL, Redis, moto's S3 for its tasks, Airflow) until the block ends;
    then every process of it stopped and every namespace removed, whatever failed.

    ``seed_s3(endpoint)`` fills the deployment's own S3 server: the session's moto listens on this machine's
    loopback, which a host's loopback is not. The deployment's AWS connection points at it.

    ``training_hosts``: that many more hosts, after the triggerer's, with an sshd each
    (tests/sshd_cluster.py; ``deployment.training``), where the tasks' ssh jobs run: a worker's
    host that fails takes none of the job's nodes with it. Its key and known_hosts are in
    DTRAIN_TEST_SSH_KEY and DTRAIN_TEST_SSH_KNOWN_HOSTS (tests/dags read them)."""
    from dtrain.pipeline.demo import airflow_env

    with contextlib.ExitStack() as stack:
        net = NetCluster(2 + len(WORKERS) + training_hosts, decoy=False).start()
        stack.callback(net.stop)
        subnet = str(net.subnet)
        db = Postgres(net.gateway, subnet).start()
        stack.callback(db.stop)
        os.makedirs(home, exist_ok=True)
        broker = Redis(net.gateway, home).start()
        stack.callback(broker.stop)
        s3 = stack.enter_context(contextlib.contextmanager(moto_server)(net.gateway))
        if seed_s3 is not None:
            seed_s3(s3)
        env = dict(env, AIRFLOW_CONN_AWS_DEFAULT=airflow_env(s3)["AIRFLOW_CONN_AWS_DEFAULT"])
        training = None
        if training_hosts:
            from tests.sshd_cluster import start_cluster

            training = start_cluster(os.path.join(home, "sshd"), net=net, on=net.hosts[2 + len(WORKERS):])
            stack.callback(training.stop)
            env.update(DTRAIN_TEST_SSH_KEY=training.key_file, DTRAIN_TEST_SSH_KNOWN_HOSTS=training.known_hosts)
        deployment = CeleryDeployment(home, env, dags_folder, bundles, net=net, db_url=db.create_database("airflow"),
                                      broker_url=broker.url)
        deployment.s3_endpoint, deployment.training = s3, training
        stack.callback(deployment.stop)
        deployment.start(dag_ids)
        yield deployment


__all__ = ["CeleryDeployment", "Postgres", "Redis", "celery_deployment"]
