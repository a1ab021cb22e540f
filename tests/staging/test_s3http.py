"""The lean S3 client (no botocore): its SigV4 against botocore's, when it is chosen, and its
requests against real S3 servers (moto; one that enforces signatures).

One test stands in for AWS itself (a region redirect), which cannot run here: a loopback
HTTP server plays AWS's "this bucket lives in another region" answer, and says so.
"""

from __future__ import annotations

import http.client
import http.server
import os
import subprocess
import sys
import threading

import pytest

from dtrain.staging import s3http
from dtrain.staging.engine import stage
from dtrain.staging.errors import StagingError
from dtrain.staging.sigv4 import Credentials, Signer
from dtrain.staging.sources import LeanS3Source, NativeS3Source, open_source

from .conftest import REGION

BIN = os.path.dirname(sys.executable)
NOW = 1_780_000_000.0  # a fixed instant, so both signers sign the same x-amz-date


def botocore_signature(creds: Credentials, region: str, method: str, host: str, path: str, query: dict,
                       headers: dict[str, str]) -> str:
    """What botocore's own S3 signer computes for the same request (the reference)."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCredentials

    from botocore.utils import percent_encode

    # Encoded the way botocore's REST serializer encodes a key ({Key+}) and query parameters.
    url = f"http://{host}{percent_encode(path, safe='/~')}"
    request = AWSRequest(method=method, url=url, params=query,
                         headers={k: v for k, v in headers.items() if k not in ("host", "Authorization")})
    request.context["timestamp"] = headers["x-amz-date"]
    auth = S3SigV4Auth(BotoCredentials(creds.access_key, creds.secret_key, creds.token), "s3", region)
    canonical = auth.canonical_request(request)
    return auth.signature(auth.string_to_sign(request, canonical), request)


@pytest.mark.parametrize("path,query,amz,token", [
    ("/bucket", {"list-type": "2", "prefix": "data/with space/ü+=&", "encoding-type": "url"}, {}, None),
    ("/bucket/dir/key with space+plus~tilde%percent/ü.bin", None, {}, None),
    ("/bucket/k", {"list-type": "2", "continuation-token": "1/abc+def=="}, {}, "FQoGZXIvYXdzE//token+x="),
    ("/bucket/big.bin", {"partNumber": "1"}, {"x-amz-checksum-mode": "ENABLED", "x-amz-request-payer": "requester"},
     None),
])
def test_signature_is_byte_for_byte_botocores(path, query, amz, token):
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    headers = Signer(creds, "eu-west-1").sign("GET", "127.0.0.1:9000", path, query, amz, now=NOW)
    assert headers["x-amz-date"] == "20260528T202640Z"
    ours = headers["Authorization"].rsplit("Signature=", 1)[1]
    assert ours == botocore_signature(creds, "eu-west-1", "GET", "127.0.0.1:9000", path, query or {}, headers)
    signed = headers["Authorization"].split("SignedHeaders=", 1)[1].split(",", 1)[0].split(";")
    assert all(name in signed for name in amz) and ("x-amz-security-token" in signed) == bool(token)


def test_credentials_never_print_their_secret():
    text = repr(Credentials("AKIAABCDEFGH", "topsecretvalue", "sessiontoken"))
    assert "topsecretvalue" not in text and "sessiontoken" not in text


CLEAN = {"AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": "s1", "AWS_DEFAULT_REGION": "eu-west-1",
         "AWS_CONFIG_FILE": "/nonexistent/aws-config"}


@pytest.mark.parametrize("options,env,expect", [
    ({}, CLEAN, ("https", None, "eu-west-1", "AKIA1")),
    ({"key": "AKIA2", "secret": "s2", "token": "t"}, CLEAN, ("https", None, "eu-west-1", "AKIA2")),
    ({"endpoint_url": "http://127.0.0.1:9000"}, CLEAN, ("http", "127.0.0.1:9000", "eu-west-1", "AKIA1")),
    ({}, {**CLEAN, "AWS_ENDPOINT_URL": "http://localhost:9000"}, ("http", "localhost:9000", "eu-west-1", "AKIA1")),
    ({"endpoint_url": "https://minio.internal", "config_kwargs": {"s3": {"addressing_style": "path"}}}, CLEAN,
     ("https", "minio.internal", "eu-west-1", "AKIA1")),
    ({"anon": True}, {"AWS_CONFIG_FILE": "/nonexistent"}, ("https", None, "us-east-1", None)),
    ({"client_kwargs": {"region_name": "ap-south-1"}}, CLEAN, ("https", None, "ap-south-1", "AKIA1")),
    # Every case below is botocore's to decide:
    ({}, {**CLEAN, "AWS_PROFILE": "prod"}, None),                         # a profile
    ({}, {k: v for k, v in CLEAN.items() if not k.startswith("AWS_ACC")}, None),  # credential chain
    ({"key": "AKIA2"}, CLEAN, None),                                       # key without secret
    ({}, {**CLEAN, "AWS_USE_FIPS_ENDPOINT": "true"}, None),                # an AWS_* it does not know
    ({}, {**CLEAN, "HTTPS_PROXY": "http://proxy:3128"}, None),             # a proxy
    ({"endpoint_url": "https://minio.internal"}, CLEAN, None),             # virtual-host on a custom host
    ({"client_kwargs": {"region_name": "cn-north-1"}}, CLEAN, None),       # another partition
    ({"profile": "x"}, CLEAN, None),
    ({"config_kwargs": {"proxies": {"https": "p"}}}, CLEAN, None),
])
def test_lean_client_is_chosen_only_where_it_matches_botocore(options, env, expect):
    settings = s3http.lean_settings(options, env)
    if expect is None:
        assert settings is None
        return
    assert settings is not None
    creds = settings.credentials.access_key if settings.credentials else None
    assert (settings.scheme, settings.endpoint, settings.region, creds) == expect


def test_an_aws_config_file_sends_the_stage_to_botocore(tmp_path):
    config = tmp_path / "config"
    config.write_text("[default]\nregion = eu-central-1\n")
    assert s3http.lean_settings({}, {**CLEAN, "AWS_CONFIG_FILE": str(config)}) is None


def test_bucket_names_aws_cannot_address_as_a_virtual_host_go_to_botocore():
    aws = s3http.lean_settings({}, CLEAN)
    assert s3http.bucket_supported(aws, "my-bucket-1")
    assert not s3http.bucket_supported(aws, "dotted.bucket.name")
    assert not s3http.bucket_supported(aws, "express--use1-az4--x-s3")
    assert not s3http.bucket_supported(aws, "arn:aws:s3:us-east-1:123:accesspoint/ap")


def test_default_source_is_lean_and_a_stage_never_imports_botocore(s3, tmp_path):
    s3.put("p/a.bin", b"a" * 10)
    assert isinstance(open_source(s3.url("p/"), None, 4), LeanS3Source)
    os.environ["DTRAIN_S3_CLIENT"] = "botocore"
    try:
        assert isinstance(open_source(s3.url("p/"), None, 4), NativeS3Source)
    finally:
        del os.environ["DTRAIN_S3_CLIENT"]
    code = ("import sys; from dtrain.staging.engine import stage; "
            f"r = stage({s3.url('p/')!r}, {str(tmp_path / 'd')!r}); "
            "print(r.fetched, sorted(m for m in sys.modules if m.split('.')[0] in ('botocore', 'boto3', 's3fs')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                         timeout=120, check=True)
    assert out.stdout.split() == ["1", "[]"], out.stdout + out.stderr


def test_unusual_keys_round_trip_through_listing_and_reads(s3, tmp_path):
    keys = {"p/with space.bin": b"1", "p/plus+sign.bin": b"2", "p/ünïcødé/é.txt": b"3", "p/tilde~pct%25.bin": b"4",
            "p/amp&eq=semi;.bin": b"5", "p/" + "x" * 200 + ".bin": b"6"}
    s3.put_many(keys)
    stage(s3.url("p/"), str(tmp_path / "d"))
    for key, body in keys.items():
        assert (tmp_path / "d" / key[2:]).read_bytes() == body


def test_listing_pages_through_more_than_one_response(s3, tmp_path):
    s3.put_many({f"p/{i:05d}": b"x" for i in range(1005)})  # S3 answers at most 1,000 keys per page
    client = s3http.S3Http(s3http.lean_settings({}), s3.bucket)
    found = client.list("p/")
    assert len(found) == 1005 and found[f"{s3.bucket}/p/01004"]["size"] == 1


def test_signatures_are_checked_by_a_server_that_enforces_them(auth_server, tmp_path, monkeypatch):
    endpoint, key_id, secret = auth_server
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    good = {"key": key_id, "secret": secret}
    assert isinstance(open_source("s3://secured/ds/", good, 2), LeanS3Source)
    result = stage("s3://secured/ds/", str(tmp_path / "d"), storage_options=good)
    assert result.fetched == 1 and (tmp_path / "d" / "a.bin").read_bytes() == b"secret data"
    with pytest.raises(StagingError, match="denied: check the credentials"):
        stage("s3://secured/ds/", str(tmp_path / "e"), storage_options={"key": key_id, "secret": secret + "x"})
    assert not (tmp_path / "e" / "a.bin").exists()


class _WrongRegionAws(http.server.BaseHTTPRequestHandler):
    """Mock of AWS (cannot run here): a bucket in eu-west-1 asked for at us-east-1's endpoint
    answers 301 with x-amz-bucket-region, as S3 does; at the right endpoint it lists one key."""
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str]] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        host, auth = self.headers["Host"], self.headers.get("Authorization", "")
        self.seen.append((host, auth.split("Credential=", 1)[1].split(",", 1)[0]))
        if ".us-east-1." in host:
            self.send_response(301)
            self.send_header("x-amz-bucket-region", "eu-west-1")
            body = b"<Error><Code>PermanentRedirect</Code></Error>"
        else:
            self.send_response(200)
            body = (b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><IsTruncated>false'
                    b'</IsTruncated><Contents><Key>p/a.bin</Key><ETag>"0cc175b9c0f1b6a831c399e269772661"</ETag>'
                    b'<Size>1</Size></Contents></ListBucketResult>')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_bucket_in_another_region_is_followed_there(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _WrongRegionAws)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = s3http.lean_settings({}, {**CLEAN, "AWS_DEFAULT_REGION": "us-east-1"})
        settings = s3http.replace(settings, scheme="http")
        client = s3http.S3Http(settings, "bucket")
        port = server.server_address[1]
        # Every AWS host name is routed to the loopback mock; the Host header stays AWS's.
        monkeypatch.setattr(client, "_connection", lambda host: http.client.HTTPConnection("127.0.0.1", port, timeout=10))
        assert client.list("p/") == {"bucket/p/a.bin": {"ETag": '"0cc175b9c0f1b6a831c399e269772661"', "size": 1}}
        assert [host for host, _ in _WrongRegionAws.seen] == ["bucket.s3.us-east-1.amazonaws.com",
                                                              "bucket.s3.eu-west-1.amazonaws.com"]
        assert "/eu-west-1/s3/aws4_request" in _WrongRegionAws.seen[-1][1]  # signed for the bucket's region
        assert client.region == "eu-west-1"
    finally:
        server.shutdown()
        server.server_close()

