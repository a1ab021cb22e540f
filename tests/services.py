"""The suite's daemons, one of each per test session: moto's S3 server, the sshd "hosts" and the
two-node Slurm cluster.

Defined here once and imported by tests/conftest.py, so every folder shares one instance: a
fixture defined (or imported) in two conftests is two fixtures, and the suite used to start two
Slurm clusters and three sshd clusters that way. Under pytest-xdist every worker is a session of
its own; tests that use an sshd or Slurm cluster all run on one worker (the ``cluster`` group,
tests/conftest.py), so each cluster still starts once per suite.
"""

from __future__ import annotations

import os
import socket

import pytest

from tests.support import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int, address: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def moto_server(address: str = "127.0.0.1"):
    """moto's S3 server (ThreadedMotoServer) on a free port of ``address``: yields its endpoint URL, and
    stops it when closed."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address=address, port=port, verbose=False)
    server.start()
    try:
        wait_for(lambda: _port_open(port, address), what="moto server")
        yield f"http://{address}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_endpoint():
    """moto's S3 server on a free loopback port, as s3fs's own tests run it. Tests share it: each makes
    buckets of its own and removes them (never a server-wide reset)."""
    yield from moto_server()


def remove_bucket(client, bucket: str) -> None:
    """Delete ``bucket`` with every object and unfinished upload in it. Not moto's server-wide
    reset: the server is the suite's, and other tests' buckets live there."""
    for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    # Listed whole before anything is deleted: moto resumes a listing after its marker key, and
    # finds nothing after a marker that was deleted meanwhile (a bucket of 1,005 objects kept 5).
    doomed = [{"Key": o["Key"], "VersionId": o["VersionId"]}
              for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket)
              for o in page.get("Versions", []) + page.get("DeleteMarkers", [])]
    for start in range(0, len(doomed), 1000):  # S3 deletes at most 1,000 keys per request
        client.delete_objects(Bucket=bucket, Delete={"Objects": doomed[start:start + 1000]})
    client.delete_bucket(Bucket=bucket)


@pytest.fixture
def s3_bucket(moto_endpoint, monkeypatch):
    """A fresh bucket on the suite's moto server, with the standard AWS variables pointing at it for
    this test (boto3, s3fs and the product's own code read them); removed afterwards."""
    import uuid

    import boto3
    import s3fs

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": moto_endpoint}.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3")
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    s3fs.S3FileSystem.clear_instance_cache()  # a cached filesystem would still use an earlier test's settings
    try:
        yield bucket
    finally:
        remove_bucket(client, bucket)


@pytest.fixture(scope="session")
def ssh_cluster(tmp_path_factory):
    """Two real sshd daemons on 127.0.0.1 (tests/sshd_cluster.py), stopped at teardown."""
    from tests.sshd_cluster import start_cluster

    if os.geteuid() != 0:
        pytest.skip("the sshd fixture runs sshd as root (it logs in as root with a test key)")
    cluster = start_cluster(str(tmp_path_factory.mktemp("sshd")), count=2)
    try:
        yield cluster
    finally:
        cluster.stop()


def _net_ssh_cluster(count: int, directory: str):
    from tests.netcluster import NetCluster
    from tests.sshd_cluster import start_cluster

    if os.geteuid() != 0:
        pytest.skip("network namespaces and sshd need root")
    net = NetCluster(count).start()
    try:
        cluster = start_cluster(directory, net=net)  # its .net is the hosts' network
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        net.stop()


@pytest.fixture(scope="session")
def net_cluster(tmp_path_factory):
    """Three hosts with their own addresses (tests/netcluster.py: network namespaces on a bridge; host 0
    with a decoy interface listed first), an sshd on each (port 22 of its address). The sshd cluster it
    yields has the hosts' network as ``.net`` (its faults). Everything is removed at teardown."""
    yield from _net_ssh_cluster(3, str(tmp_path_factory.mktemp("net-sshd")))


@pytest.fixture
def faulty_cluster(tmp_path_factory):
    """Two such hosts of this test's own, for a test that breaks one (crash, partition, freeze)."""
    yield from _net_ssh_cluster(2, str(tmp_path_factory.mktemp("faulty-sshd")))


def _net_slurm_cluster(count: int = 2):
    """A real Slurm cluster (tests/slurm_cluster.py) of ``count`` nodes (two by default), on hosts with their own addresses
    (tests/netcluster.py): each node's slurmd on its host with that address as NodeAddr, node 1 (host 0)
    with the decoy interface listed first; slurmctld and the client commands on this machine.
    SLURM_CONF points at it meanwhile.

    Skipped only when not root (slurmd must run jobs as their user; namespaces need root); missing
    Slurm packages are an error, since CI installs them (scripts/apt-packages.txt)."""
    from tests.netcluster import NetCluster
    from tests.slurm_cluster import SlurmCluster, missing_binaries

    if os.geteuid() != 0:
        pytest.skip("the Slurm tests start slurmd, which must run as root to run jobs; run them as root")
    missing = missing_binaries()
    if missing:
        pytest.fail(f"Slurm/munge binaries missing: {missing}; install: apt-get install slurmctld slurmd slurm-client munge")
    net = NetCluster(count).start()
    try:
        cluster = SlurmCluster(net=net).start()
        saved = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = cluster.conf
        try:
            yield cluster
        finally:
            cluster.stop()
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved
            left = cluster.pids()
            assert not left, f"processes of the test cluster left after teardown: {sorted(left)}"
            assert not os.path.exists(cluster.root), f"the test cluster's directory is left: {cluster.root}"
    finally:
        net.stop()


@pytest.fixture(scope="session")
def slurm_cluster():
    """The Slurm cluster the Slurm tests share (:func:`_net_slurm_cluster`)."""
    yield from _net_slurm_cluster()


@pytest.fixture
def faulty_slurm():
    """A Slurm cluster of this test's own (:func:`_net_slurm_cluster`), for a test that breaks one of its
    hosts (crash, partition, freeze); its ``.net`` has the faults. SLURM_CONF points at it meanwhile."""
    yield from _net_slurm_cluster()


@pytest.fixture
def slurm(slurm_cluster):
    """The cluster, checked idle before and after each test (no job left behind)."""
    import time

    from tests.slurm_cluster import queue

    assert queue(slurm_cluster) == [], "a previous test left a job in the queue"
    yield slurm_cluster
    deadline = time.monotonic() + 30
    while queue(slurm_cluster) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert queue(slurm_cluster) == [], "the test left a job in the queue"


#: the fixtures that start a cluster: tests using any of them share one xdist worker
CLUSTER_FIXTURES = frozenset({"ssh_cluster", "slurm_cluster", "slurm"})
#: fixtures that make a cluster of the test's own (network namespaces: fine on any worker)
OWN_CLUSTER_FIXTURES = frozenset({"faulty_cluster", "faulty_slurm"})
