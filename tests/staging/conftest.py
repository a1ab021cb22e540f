"""Fixtures for staging tests: moto's real S3 server on loopback, and a fault-injecting proxy.

The moto server is the suite's (``moto_endpoint``, tests/services.py); each test gets a bucket of
its own, removed afterwards. AWS_* variables are set only
inside fixtures (monkeypatch), never at import time.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import urllib.request
import http.server
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest
from tests.support import wait_for  # noqa: F401 (re-exported to the tests here)

REGION = "us-east-1"


from tests.services import _port_open, free_port, remove_bucket  # noqa: E402,F401 (re-exported to the tests here)


@dataclass
class S3:
    endpoint: str
    bucket: str
    client: object

    def put(self, key: str, body: bytes, **kwargs) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body, **kwargs)

    def put_multipart(self, key: str, body: bytes, part_size: int = 5 * 1024 * 1024) -> str:
        mpu = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)
        parts = []
        for number, start in enumerate(range(0, len(body), part_size), 1):
            r = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=mpu["UploadId"], PartNumber=number,
                                        Body=body[start:start + part_size])
            parts.append({"ETag": r["ETag"], "PartNumber": number})
        r = self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=mpu["UploadId"],
                                                  MultipartUpload={"Parts": parts})
        return r["ETag"].strip('"')

    def put_many(self, items: dict[str, bytes]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda kv: self.put(*kv), items.items()))

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}"


def aws_env(monkeypatch, endpoint: str) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    """A fresh bucket on the moto server; AWS env points at it for this test only."""
    import boto3

    aws_env(monkeypatch, moto_endpoint)
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name=REGION,
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    try:
        yield S3(moto_endpoint, bucket, client)
    finally:
        remove_bucket(client, bucket)


# --- a fault-injecting HTTP proxy in front of moto ---------------------------------------------

@dataclass
class Faults:
    corrupt: dict[str, int] = field(default_factory=dict)    # key substring -> GETs left to corrupt
    truncate: dict[str, int] = field(default_factory=dict)   # key substring -> GETs left to cut short
    bytes_per_second: float = 0.0                            # throttle every body (0: no throttle)
    gets: list[str] = field(default_factory=list)            # object GET paths seen
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, table: dict[str, int], path: str) -> bool:
        with self.lock:
            for needle, left in table.items():
                if needle in path and left > 0:
                    table[needle] = left - 1
                    return True
        return False


# Query parameters of a presigned URL (SigV2 and SigV4): still a plain object GET.
PRESIGN_PARAMS = {"AWSAccessKeyId", "Signature", "Expires", "X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Date",
                  "X-Amz-Expires", "X-Amz-SignedHeaders", "X-Amz-Signature", "X-Amz-Security-Token"}


class _Proxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream_port: int, faults: Faults):
        self.upstream_port = upstream_port
        self.faults = faults
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _forward(self) -> None:
        faults: Faults = self.server.faults
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
        upstream.request(self.command, self.path, body=body, headers=headers)
        response = upstream.getresponse()
        data = response.read()
        upstream.close()
        path = self.path.split("?", 1)[0]
        query = self.path.split("?", 1)[1] if "?" in self.path else ""
        params = {p.split("=", 1)[0] for p in query.split("&") if p} - PRESIGN_PARAMS
        is_object_get = (self.command == "GET" and response.status in (200, 206) and len(path.strip("/").split("/")) >= 2
                         and params <= {"x-id", "versionId", "partNumber"})
        truncate = False
        if is_object_get:
            with faults.lock:
                faults.gets.append(path)
            if data and faults.take(faults.corrupt, path):
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            truncate = bool(data) and faults.take(faults.truncate, path)
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(key, value)
        upstream_length = response.getheader("Content-Length")
        self.send_header("Content-Length", upstream_length if self.command == "HEAD" and upstream_length
                         else str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if truncate:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        step = 64 * 1024
        for start in range(0, len(data), step):
            self.wfile.write(data[start:start + step])
            if faults.bytes_per_second:
                time.sleep(step / faults.bytes_per_second)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


@pytest.fixture
def proxy(moto_endpoint):
    """(proxy endpoint URL, Faults) forwarding to moto; faults are set by the test."""
    faults = Faults()
    server = _Proxy(int(moto_endpoint.rsplit(":", 1)[1]), faults)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", faults
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


# --- a second moto server, in its own process, that enforces credentials -----------------------

@pytest.fixture(scope="session")
def auth_server():
    """(endpoint, access key id, secret) of a moto server with IAM auth on and bucket ``secured``
    holding ``ds/a.bin``. A separate process: switching auth on is global to a moto server."""
    import boto3

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "INITIAL_NO_AUTH_ACTION_COUNT"}
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_for(lambda: _port_open(port), what="auth moto server")
        endpoint = f"http://127.0.0.1:{port}"
        setup = dict(endpoint_url=endpoint, region_name=REGION, aws_access_key_id="setup",
                     aws_secret_access_key="setup")
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="stager")
        iam.put_user_policy(UserName="stager", PolicyName="read", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="stager")["AccessKey"]
        s3 = boto3.client("s3", **setup)
        s3.create_bucket(Bucket="secured")
        s3.put_object(Bucket="secured", Key="ds/a.bin", Body=b"secret data")
        # From now on every request must carry a known access key.
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                                      headers={"Content-Type": "text/plain"})).read()
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


