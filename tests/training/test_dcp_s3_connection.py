"""DCP checkpoints to s3:// with credentials from an Airflow AWS connection only (issue 26, point 3).

A real Airflow task (dag.test) runs a real 2-rank gloo job whose processes have no AWS variable of
their own: ``DistributedTrainingOperator(aws_conn_id=...)`` reads the connection (AIRFLOW_CONN_<ID>)
on the worker and hands every rank the standard AWS variables. The job checkpoints to the suite's
moto server; a second run resumes from it (a load through the same connection). While the job
runs, every process of it is read with psutil: the secret is in no argv; after it, in no file of the
run directory, no XCom and no line of the task log."""

from __future__ import annotations

import json
import os
import threading
import uuid

import pytest

from tests.conftest import load_test_dag
from tests.remote_jobs import needs_sshd
from tests.services import remove_bucket
from tests.training.dcp_checks import assert_same_state

pytestmark = pytest.mark.timeout(300)

#: what could hand a rank credentials besides the connection: all removed for these tests
AMBIENT_AWS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
               "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION")


class ArgvWatch:
    """Reads the argv of every process on this machine until stopped (a finalizer stops it): the ranks
    of an ssh job are below the hosts' sshd, not below this process."""

    def __init__(self):
        self.argvs: set[tuple[str, ...]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import psutil

        while not self._stop.wait(0.1):
            for proc in psutil.process_iter():
                try:
                    self.argvs.add(tuple(proc.cmdline()))
                except psutil.Error:
                    pass  # ended between the listing and the read, or not ours to read

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def connection_only(moto_endpoint, connection_to):
    """(client, bucket, secret): a fresh bucket on the suite's moto, and AIRFLOW_CONN_DTRAIN_CKPT_S3 the
    only way to reach it."""
    return connection_to(moto_endpoint)


@pytest.fixture
def connection_to(monkeypatch, tmp_path, request):
    """What :func:`connection_only` gives, for the S3 endpoint passed in."""
    return lambda endpoint: _connection_only(endpoint, monkeypatch, tmp_path, request)


def _connection_only(moto_endpoint: str, monkeypatch, tmp_path, request):
    import boto3

    for name in AMBIENT_AWS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    key_id, secret = "AKIACKPTCONN", f"ckpt-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AIRFLOW_CONN_DTRAIN_CKPT_S3", json.dumps({
        "conn_type": "aws", "login": key_id, "password": secret,
        "extra": {"endpoint_url": moto_endpoint, "region_name": "us-east-1"}}))
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                          aws_access_key_id=key_id, aws_secret_access_key=secret)
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    request.addfinalizer(lambda: remove_bucket(client, bucket))
    return client, bucket, secret


def files_holding(root, secret: str) -> list[str]:
    """Every file under ``root`` whose bytes contain ``secret``; and there must be files to read."""
    paths = [os.path.join(d, name) for d, _, names in os.walk(root) for name in names]
    assert paths, f"nothing written under {root}"
    return [p for p in paths if not os.path.islink(p) and secret.encode() in open(p, "rb").read()]


def run_and_check(client, bucket: str, secret: str, tmp_path, capfd, request, resume: bool = False, **params) -> None:
    """A run of the test DAG checkpoints to s3:// through the connection (and with ``resume``, a second
    run resumes from it); the secret nowhere it must not be."""
    location, out = f"s3://{bucket}/runs/conn/ckpt", tmp_path / "out"
    out.mkdir()
    dag = load_test_dag("ckpt_conn_dags.py", "ckpt_s3_connection")
    watch = ArgvWatch()
    request.addfinalizer(watch.stop)
    conf = {"dir": location, "out": str(out), "steps": 4, "run_dir": str(tmp_path / "run1"), **params}
    first = dag.test(run_conf=conf)
    watch.stop()
    log = capfd.readouterr()
    ti = next(t for t in first.get_task_instances() if t.task_id == "train")
    assert ti.state == "success", log.out[-3000:] + log.err[-3000:]

    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="runs/conn/ckpt/").get("Contents", [])}
    assert "runs/conn/ckpt/dcp/step-00000004/dtrain-commit.json" in keys
    ranks = [a for a in watch.argvs if str(out) in a and any(arg.endswith("dcp_job.py") for arg in a)]
    assert len(ranks) >= 2, sorted(watch.argvs)  # the watch saw the ranks themselves
    assert not [a for a in watch.argvs if any(secret in arg for arg in a)]
    assert files_holding(tmp_path / "run1", secret) == []
    xcoms = [ti.xcom_pull(task_ids="train"), ti.xcom_pull(task_ids="train", key="dtrain_run")]
    assert xcoms[0]["world_size"] == 2 and secret not in json.dumps(xcoms)
    assert secret not in log.out + log.err
    if not resume:
        return

    # A second run resumes from step 4: the ranks load the checkpoint through the connection too.
    second = dag.test(run_conf=conf | {"steps": 6, "run_dir": str(tmp_path / "run2")})
    log = capfd.readouterr()
    assert next(t for t in second.get_task_instances() if t.task_id == "train").state == "success", log.err[-3000:]
    assert_same_state(out / "ref-4.pt", out / "loaded-4.pt")
    assert secret not in log.out + log.err


def test_local_job_checkpoints_to_s3_with_the_connection_only(airflow_db, connection_only, tmp_path, capfd, request):
    run_and_check(*connection_only, tmp_path, capfd, request, resume=True, backend="local")


@needs_sshd
def test_ssh_job_checkpoints_to_s3_with_the_connection_only(airflow_db, ssh_cluster, connection_only, tmp_path,
                                                            capfd, request):
    """Over ssh (durable mode: the detached node daemons) the env travels on each session's stdin."""
    hosts = [f"root@{h.line} slots=1" for h in ssh_cluster.hosts]
    run_and_check(*connection_only, tmp_path, capfd, request, backend="ssh",
                  ssh={"hosts": hosts, **ssh_cluster.ssh_settings()})
    assert (tmp_path / "run1" / "detached").is_dir()  # the detached daemons' path, whose files were read too


@pytest.fixture
def bridge_moto(slurm):
    """A moto server the Slurm nodes reach: on the bridge's address (their hosts have their own loopback)."""
    from tests.services import moto_server

    yield from moto_server(slurm.controller_address)


def test_slurm_job_checkpoints_to_s3_with_the_connection_only(airflow_db, slurm, bridge_moto, connection_to, tmp_path,
                                                              capfd, request):
    """Through Slurm the credentials ride in sbatch's environment: not in the script in the run directory."""
    run_and_check(*connection_to(bridge_moto), tmp_path, capfd, request, backend="slurm",
                  slurm={"poll_interval": 0.3})
    assert (tmp_path / "run1" / "slurm-job.sh").is_file()  # the script was there to be read, without the secret
