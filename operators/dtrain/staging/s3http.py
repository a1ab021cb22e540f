"""A lean S3 client for staging: list, HEAD and ranged GET over ``http.client``, signed with SigV4.

Why: a stage is a short-lived process, and on the 2-core machines this project targets,
importing botocore and building a client (service model, endpoint rules) cost about 0.2 s of
CPU before the first byte moved, and its per-request pipeline about 2 ms of CPU more. This
client needs neither. It is used only where its behaviour is exactly botocore's:

- credentials given explicitly (storage options key/secret/token, the way the Airflow operator
  passes a connection's) or by AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or anonymous access;
- no AWS config file and no profile (either may set a region, an endpoint or an addressing
  style), no proxy, and no AWS_* variable it does not know;
- an endpoint it can address as botocore would: a custom endpoint (AWS_ENDPOINT_URL[_S3] or
  endpoint_url) on an IP address or localhost, or with ``addressing_style`` "path"; or AWS's
  standard partition with a DNS-compatible bucket name (virtual-hosted style).

:func:`lean_settings` returns None in every other case, and the caller uses botocore.
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import re
import ssl
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass, replace
from typing import Any, Iterator, Mapping

from dtrain.staging.s3read import raise_for_status, read_blocks
from dtrain.staging.sigv4 import Credentials, Signer, canonical_query, quote_path

# Bytes read per block. 1 MiB stays in the CPU cache between the socket read, the hash and the
# write; the buffer is reused per thread, so no block is ever allocated.
BLOCK = 1024 * 1024

_OPTIONS = frozenset({
    "key", "secret", "token", "username", "password", "endpoint_url", "client_kwargs", "config_kwargs",
    "anon", "use_ssl", "requester_pays", "skip_instance_cache", "use_listings_cache", "listings_expiry_time",
    "default_block_size", "default_fill_cache", "default_cache_type", "max_concurrency", "cache_regions",
})
_CLIENT_KWARGS = frozenset({"region_name", "endpoint_url", "aws_access_key_id", "aws_secret_access_key",
                            "aws_session_token", "verify", "use_ssl"})
_CONFIG_KWARGS = frozenset({"max_pool_connections", "connect_timeout", "read_timeout", "s3", "retries",
                            "response_checksum_validation", "request_checksum_calculation"})
# AWS_* variables whose meaning this client reproduces (or that do not concern it).
_ENV = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_EC2_METADATA_DISABLED", "AWS_CA_BUNDLE",
    "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE",
    "AWS_METADATA_SERVICE_TIMEOUT", "AWS_METADATA_SERVICE_NUM_ATTEMPTS", "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_RESPONSE_CHECKSUM_VALIDATION", "AWS_DEFAULT_OUTPUT", "AWS_PAGER",
})
_PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
_AWS_REGION = re.compile(r"^(us|eu|ap|sa|ca|me|af|il|mx)-[a-z]+-\d+$")
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_NS = re.compile(r"^\{[^}]*\}")


@dataclass(frozen=True)
class Settings:
    credentials: Credentials | None  # None: anonymous (unsigned) requests
    region: str
    scheme: str                      # http | https
    endpoint: str | None             # host[:port] of a custom endpoint; None: AWS's own
    base_path: str                   # path prefix of a custom endpoint, usually ""
    verify: bool | str               # TLS: True, False or a CA bundle path
    requester_pays: bool
    timeout: float


def lean_settings(options: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ) -> Settings | None:
    """Settings for :class:`S3Http` when it reproduces botocore exactly for these storage options
    and this environment; None when botocore must decide (see the module docstring)."""
    options = dict(options or {})
    client = dict(options.get("client_kwargs") or {})
    config = dict(options.get("config_kwargs") or {})
    if not set(options) <= _OPTIONS or not set(client) <= _CLIENT_KWARGS or not set(config) <= _CONFIG_KWARGS:
        return None
    if any(name.startswith("AWS_") and name not in _ENV for name in environ):
        return None  # a profile, FIPS/dual-stack endpoints, ...: botocore's to interpret
    if any(environ.get(name) for name in _PROXY_ENV):
        return None
    config_file = environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    if os.path.exists(config_file):
        return None
    credentials = _credentials(options, client, environ)
    if credentials is False:
        return None
    addressing = (config.get("s3") or {}).get("addressing_style", "auto")
    if not set(config.get("s3") or {}) <= {"addressing_style"}:
        return None
    use_ssl = client.get("use_ssl", options.get("use_ssl", True))
    verify = client.get("verify", environ.get("AWS_CA_BUNDLE") or True)
    region = client.get("region_name") or environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint_url = (options.get("endpoint_url") or client.get("endpoint_url") or environ.get("AWS_ENDPOINT_URL_S3")
                    or environ.get("AWS_ENDPOINT_URL"))
    timeout = float(config.get("read_timeout") or 60)
    base = Settings(credentials or None, region, "https" if use_ssl else "http", None, "", verify,
                    bool(options.get("requester_pays")), timeout)
    if endpoint_url:
        url = urllib.parse.urlsplit(endpoint_url)
        if url.scheme not in ("http", "https") or not url.hostname or url.query:
            return None
        if addressing != "path" and not _is_ip_or_localhost(url.hostname):
            return None  # botocore would use virtual-hosted style on this host: leave it to botocore
        return replace(base, scheme=url.scheme, endpoint=url.netloc, base_path=url.path.rstrip("/"))
    if addressing == "path" or not _AWS_REGION.match(region):
        return None  # other partitions and path style on AWS: botocore's endpoint rules decide
    return base


def _credentials(options: dict, client: dict, environ: Mapping[str, str]) -> Credentials | None | bool:
    """Explicit credentials, None for anonymous access, or False when botocore must find them."""
    if options.get("anon"):
        return None
    key = client.get("aws_access_key_id") or options.get("key") or options.get("username")
    secret = client.get("aws_secret_access_key") or options.get("secret") or options.get("password")
    token = client.get("aws_session_token") or options.get("token")
    if key or secret:
        return Credentials(key, secret, token) if key and secret else False
    key, secret = environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return Credentials(key, secret, environ.get("AWS_SESSION_TOKEN") or None)
    return False  # a credentials file, instance role, SSO, ...: botocore's provider chain


def _is_ip_or_localhost(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def bucket_supported(settings: Settings, bucket: str) -> bool:
    """Whether this client can address ``bucket`` (AWS's virtual hosts need a DNS-safe name)."""
    if settings.endpoint is not None:
        return bool(bucket) and "/" not in bucket and ":" not in bucket
    return bool(_DNS_BUCKET.match(bucket)) and not bucket.endswith(("--x-s3", "--ol-s3"))


class S3ResponseError(Exception):
    """A request S3 answered with an error status; ``code`` is S3's error code when it sent one."""

    def __init__(self, status: int, code: str, message: str = ""):
        super().__init__(f"HTTP {status} {code}: {message}".rstrip(": "))
        self.status, self.code, self.message = status, code, message


class S3Http:
    """List, HEAD and ranged GET for one bucket; thread-safe, one keep-alive connection per thread."""

    def __init__(self, settings: Settings, bucket: str):
        self.settings = settings
        self.bucket = bucket
        self._lock = threading.Lock()
        self._local = threading.local()
        self._use_region(settings.region)
        self._tls = None
        if settings.scheme == "https":
            verify = settings.verify
            self._tls = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
            if verify is False:
                self._tls.check_hostname = False
                self._tls.verify_mode = ssl.CERT_NONE

    def _use_region(self, region: str) -> None:
        """Route requests to ``region``: one tuple swapped at once, so a thread never signs for
        one region and sends to another's host."""
        creds = self.settings.credentials
        signer = Signer(creds, region) if creds else None
        if self.settings.endpoint is not None:
            host, prefix = self.settings.endpoint, f"{self.settings.base_path}/{self.bucket}"
        else:
            host, prefix = f"{self.bucket}.s3.{region}.amazonaws.com", ""
        self._route = (region, host, prefix, signer)

    @property
    def region(self) -> str:
        return self._route[0]

    @property
    def host(self) -> str:
        return self._route[1]

    # --- transport -------------------------------------------------------------------------

    def _connection(self, host: str) -> http.client.HTTPConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(host)
        if conn is None:
            if self._tls is not None:
                conn = http.client.HTTPSConnection(host, timeout=self.settings.timeout, context=self._tls)
            else:
                conn = http.client.HTTPConnection(host, timeout=self.settings.timeout)
            conns[host] = conn
        return conn

    def _drop(self, host: str) -> None:
        conn = getattr(self._local, "conns", {}).pop(host, None)
        if conn is not None:
            conn.close()

    def send(self, method: str, key: str | None, query: Mapping[str, str] | None = None,
             headers: Mapping[str, str] | None = None) -> http.client.HTTPResponse:
        """Send one signed request; returns the response with its body unread. Follows S3's
        "this bucket is in another region" answer once. Raises OSError/HTTPException on transport
        failure (the connection is dropped, so a retry reconnects)."""
        for _ in range(2):
            region, host, prefix, signer = self._route
            path = prefix + ("/" + key if key is not None else ("" if prefix else "/"))
            amz = {}
            if self.settings.requester_pays:
                amz["x-amz-request-payer"] = "requester"
            for name, value in (headers or {}).items():
                if name.lower().startswith("x-amz-"):
                    amz[name.lower()] = value
            plain = {k: v for k, v in (headers or {}).items() if not k.lower().startswith("x-amz-")}
            signed = signer.sign(method, host, path, query, amz) if signer else {"host": host, **amz}
            target = quote_path(path) + ("?" + canonical_query(query) if query else "")
            conn = self._connection(host)
            try:
                conn.request(method, target, headers={**plain, **signed})
                response = conn.getresponse()
            except (OSError, http.client.HTTPException):
                self._drop(host)
                raise
            moved = response.getheader("x-amz-bucket-region")
            if (response.status in (301, 400) and moved and moved != region and self.settings.endpoint is None
                    and _AWS_REGION.match(moved)):  # the header names a host: only a well-formed region
                self.finish(response, host, drain=True)
                with self._lock:
                    if self._route[0] == region:  # not already moved by another thread
                        self._use_region(moved)
                continue
            response.dtrain_host = host  # which connection to drop if the body fails
            return response
        raise S3ResponseError(301, "PermanentRedirect", f"bucket {self.bucket!r} keeps moving between regions")

    def finish(self, response: http.client.HTTPResponse, host: str | None = None, drain: bool = False) -> None:
        """Done with a response: keep its connection for the next request unless the server closes it."""
        host = host or getattr(response, "dtrain_host", self.host)
        if drain:
            try:
                response.read()
            except (OSError, http.client.HTTPException):
                self._drop(host)
                return
        if response.will_close or not response.isclosed():
            self._drop(host)

    def _error(self, response: http.client.HTTPResponse) -> S3ResponseError:
        body = response.read()  # empty for HEAD: http.client knows it has no body
        self.finish(response)
        code, message = _xml_text(body, "Code"), _xml_text(body, "Message")
        return S3ResponseError(response.status, code or _STATUS_CODES.get(response.status, ""), message)

    def _call(self, method: str, key: str | None, query=None, headers=None, attempts: int = 4):
        """(response status, headers, body) of a small request, retried on transport errors,
        throttling and 5xx with backoff; raises S3ResponseError for any other error status."""
        delay = 0.2
        for attempt in range(attempts):
            try:
                response = self.send(method, key, query, headers)
                if response.status >= 500 and attempt < attempts - 1:
                    self.finish(response, drain=True)
                    time.sleep(delay)
                    delay *= 2
                    continue
                if response.status >= 300:
                    raise self._error(response)
                body = response.read()
                self.finish(response)
                return response.status, response.headers, body
            except (OSError, http.client.HTTPException):
                if attempt == attempts - 1:
                    raise
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    # --- the three operations ---------------------------------------------------------------

    def list(self, prefix: str) -> dict[str, dict[str, Any]]:
        """``{bucket/key: {"ETag", "size"}}`` of every object under ``prefix`` (ListObjectsV2)."""
        found: dict[str, dict[str, Any]] = {}
        query = {"list-type": "2", "encoding-type": "url"}
        if prefix:
            query["prefix"] = prefix
        while True:
            _, _, body = self._call("GET", None, query)
            root = ET.fromstring(body)
            decode = urllib.parse.unquote_plus if _child_text(root, "EncodingType") == "url" else (lambda s: s)
            for item in root:
                if _NS.sub("", item.tag) != "Contents":
                    continue
                fields = {_NS.sub("", f.tag): f.text or "" for f in item}
                found[f"{self.bucket}/{decode(fields['Key'])}"] = {"ETag": fields.get("ETag"),
                                                                   "size": int(fields.get("Size") or 0)}
            token = _child_text(root, "NextContinuationToken")
            if _child_text(root, "IsTruncated") != "true" or not token:
                return found
            query = {**query, "continuation-token": token}

    def head(self, Bucket: str | None = None, Key: str = "", ChecksumMode: str | None = None,
             PartNumber: int | None = None, **_ignored: Any) -> dict[str, Any]:
        """HEAD an object; the answer uses botocore's names for the fields staging reads."""
        headers = {"x-amz-checksum-mode": ChecksumMode} if ChecksumMode else None
        query = {"partNumber": str(PartNumber)} if PartNumber else None
        _, h, _ = self._call("HEAD", Key, query, headers)
        out: dict[str, Any] = {"ETag": h.get("ETag", ""), "ContentLength": int(h.get("Content-Length") or 0)}
        if h.get("x-amz-checksum-type"):
            out["ChecksumType"] = h["x-amz-checksum-type"]
        for algo in ("crc32", "crc32c", "sha1", "sha256", "crc64nvme"):
            value = h.get(f"x-amz-checksum-{algo}")
            if value:
                out[f"Checksum{algo.upper()}"] = value
        return out

    def fetch(self, obj: Any, start: int, end: int) -> Iterator[memoryview]:
        """Bytes [start, end) of ``obj`` as blocks of one reused per-thread buffer: each block is
        valid until the next is requested. Every read carries If-Match with the listing's ETag,
        so one file never mixes two versions. No retry here: the copier resumes the range."""
        key = obj.path.partition("/")[2]
        headers = {}
        whole = (start, end) == (0, obj.size)
        if not whole:  # a whole object is asked for without a Range: servers then skip a slicing copy
            headers["Range"] = f"bytes={start}-{end - 1}"
        if obj.etag:
            headers["If-Match"] = f'"{obj.etag}"'
        query = {"versionId": obj.version_id} if obj.version_id else None
        response = self.send("GET", key, query, headers)
        done = False
        try:
            if response.status not in (200, 206):
                error = self._error(response)
                raise_for_status(obj, error.status, error.code, error)
                raise OSError(f"GET {obj.path}: {error}")  # throttling, 5xx: the copier retries
            if response.status == 200 and not whole:
                raise OSError(f"GET {obj.path}: the store ignored the byte range")
            yield from read_blocks(response, self._buffer())
            done = True
        finally:
            if done:
                self.finish(response)
            else:
                self._drop(getattr(response, "dtrain_host", self.host))

    def close(self) -> None:
        """Close the calling thread's connections (a worker thread's close when that thread ends)."""
        for conn in getattr(self._local, "conns", {}).values():
            conn.close()
        self._local.conns = {}

    def _buffer(self) -> memoryview:
        buf = getattr(self._local, "buffer", None)
        if buf is None:
            buf = self._local.buffer = memoryview(bytearray(BLOCK))
        return buf


_STATUS_CODES = {301: "PermanentRedirect", 400: "BadRequest", 403: "AccessDenied", 404: "NotFound",
                 412: "PreconditionFailed", 503: "SlowDown"}


def _xml_text(body: bytes, tag: str) -> str:
    start = body.find(f"<{tag}>".encode())
    if start < 0:
        return ""
    stop = body.find(f"</{tag}>".encode(), start)
    return body[start + len(tag) + 2:stop].decode(errors="replace") if stop > 0 else ""


def _child_text(root: ET.Element, name: str) -> str:
    for child in root:
        if _NS.sub("", child.tag) == name:
            return child.text or ""
    return ""
