"""Ranged S3 reads through botocore on worker threads, outside s3fs's single event-loop thread.

(Where storage options and environment allow it, :mod:`dtrain.staging.s3http` does
without botocore altogether; this module serves every other case.)

Bulk bytes never go through s3fs: it reads every response body on its one asyncio
thread (aiohttp, 64 KiB flow-control steps), which capped a whole stage near one
core's worth of Python (measured: a 64 MiB GET took 1.1 s through s3fs, 0.2 s through
botocore). Instead a botocore client built from the same s3fs-style storage options
(credentials, endpoint, region, profile, config) signs the requests, and each worker
thread reads its own socket with the GIL released.

Two readers:

- ``presigned`` (default): the client presigns one GET URL per object (kept for its
  lifetime), and every range is read over a per-thread keep-alive ``http.client``
  connection. botocore's per-request pipeline costs ~2 ms of CPU; for datasets of many
  small files that, not the network, was the limit. The URL carries a signature, so it
  is never logged.
- ``botocore``: ``client.get_object`` per range; used when an HTTP proxy or a client
  certificate is configured (which plain ``http.client`` would not honour), when forced
  with ``DTRAIN_S3_READER=botocore``, and from the first presigned request the store
  answers with anything but data, 404 or 412 (a store without query-string auth, a
  throttling 503): botocore then gives the authoritative answer and its own retries.

Every range is requested with ``If-Match: <ETag>``, so parts of one file never come
from two versions of the object.
"""

from __future__ import annotations

import http.client
import os
import ssl
import threading
import time
import urllib.parse
from typing import Any, Callable, Iterator

from dtrain.staging.errors import StagingError

# Bytes held per worker: a range is streamed to disk in blocks of this size (botocore reader).
BLOCK = 8 * 1024 * 1024
# The presigned reader reads into one reused buffer per thread; 1 MiB stays in the CPU cache
# between the socket read, the hash and the write.
READ_BLOCK = 1024 * 1024
URL_LIFETIME = 3600


class SourceChanged(StagingError):
    """The object changed between the listing and the read; a rerun picks up the new version."""


def make_fetcher(options: dict | None, workers: int) -> Callable[[Any, int, int], Iterator[bytes]] | None:
    """A thread-safe ``fetch(obj, start, end) -> iterator of byte blocks`` from s3fs-style options,
    or None when they cannot be reproduced (the caller then reads through s3fs)."""
    if options is None:
        return None
    try:
        client, client_kwargs, config_kwargs = build_client(options, workers)
    except StagingError:
        return None
    extra = {"RequestPayer": "requester"} if options.get("requester_pays") else {}
    return reader_for(client, extra, client_kwargs, config_kwargs)


def reader_for(client: Any, extra: dict, client_kwargs: dict, config_kwargs: dict):
    forced = os.environ.get("DTRAIN_S3_READER", "")
    if forced == "botocore" or _needs_botocore_transport(client_kwargs, config_kwargs):
        return _botocore_reader(client, extra)
    return _PresignedReader(client, extra, client_kwargs, _botocore_reader(client, extra)).fetch


def build_client(options: dict, workers: int):
    """(botocore S3 client, client_kwargs, config_kwargs) from s3fs-style storage options, the way
    s3fs builds its own (same names, same meaning). StagingError if botocore refuses them."""
    import botocore.config
    import botocore.session

    options = dict(options)
    client_kwargs = dict(options.pop("client_kwargs", None) or {})
    key = options.pop("key", None) or options.pop("username", None)
    secret = options.pop("secret", None) or options.pop("password", None)
    init = {"aws_access_key_id": key, "aws_secret_access_key": secret,
            "aws_session_token": options.pop("token", None), "endpoint_url": options.pop("endpoint_url", None)}
    init = {k: v for k, v in init.items() if v is not None and k not in client_kwargs}
    config_kwargs = dict(options.pop("config_kwargs", None) or {})
    config_kwargs["max_pool_connections"] = max(int(config_kwargs.get("max_pool_connections") or 10), workers + 4)
    # Our own MD5/checksum verification covers the content; skip botocore's extra CRC pass.
    config_kwargs.setdefault("response_checksum_validation", "when_required")
    if options.pop("anon", False):
        from botocore import UNSIGNED
        config_kwargs["signature_version"] = UNSIGNED
        for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
            init.pop(k, None)
            client_kwargs.pop(k, None)
    use_ssl = options.pop("use_ssl", True)
    if "use_ssl" not in client_kwargs:
        init["use_ssl"] = use_ssl
    session_kwargs = {"profile": options["profile"]} if options.get("profile") else {}
    try:
        session = botocore.session.Session(**session_kwargs)
        client = session.create_client("s3", config=botocore.config.Config(**config_kwargs), **init, **client_kwargs)
    except Exception as e:  # noqa: BLE001 - unknown profile, bad config value, ...
        raise StagingError(f"cannot configure the S3 client: {type(e).__name__}: {e}") from e
    return client, client_kwargs, config_kwargs


def _needs_botocore_transport(client_kwargs: dict, config_kwargs: dict) -> bool:
    if config_kwargs.get("proxies") or config_kwargs.get("client_cert"):
        return True
    return any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"))


def raise_for_status(obj: Any, status: int, code: str, cause: BaseException | None = None) -> None:
    if status == 404 or code in ("NoSuchKey", "NoSuchBucket"):
        raise FileNotFoundError(f"{obj.path} vanished from the source during the stage") from cause
    if status == 412 or code == "PreconditionFailed":
        raise SourceChanged(f"{obj.path} changed during the stage (ETag is no longer {obj.etag}); "
                            "rerun to stage the new version") from cause
    if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
        raise PermissionError(f"access to {obj.path} denied ({code or status})") from cause


def _botocore_reader(client: Any, extra: dict):
    from botocore.exceptions import ClientError

    def fetch(obj: Any, start: int, end: int) -> Iterator[bytes]:
        bucket, _, key = obj.path.partition("/")
        kwargs = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}", **extra}
        if obj.etag:
            kwargs["IfMatch"] = f'"{obj.etag}"'
        if obj.version_id:
            kwargs["VersionId"] = obj.version_id
        try:
            body = client.get_object(**kwargs)["Body"]
        except ClientError as e:
            raise_for_status(obj, e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0,
                       str(e.response.get("Error", {}).get("Code", "")), e)
            raise
        try:
            while True:
                block = body.read(BLOCK)
                if not block:
                    return
                yield block
        finally:
            body.close()

    return fetch


class _Rejected(Exception):
    """The store refused a presigned request for a reason botocore may handle better."""


class _PresignedReader:
    """Presigned GET URLs (one per object) read over per-thread keep-alive connections."""

    def __init__(self, client: Any, extra: dict, client_kwargs: dict, fallback: Callable):
        self.client = client
        self.fallback = fallback
        self.presigned_ok = True
        self.extra = extra
        # AWS_CA_BUNDLE (or a bundle path in verify) is honoured here as botocore honours it.
        self.verify = client_kwargs.get("verify", os.environ.get("AWS_CA_BUNDLE") or True)
        self.urls: dict[str, tuple[float, urllib.parse.SplitResult]] = {}
        self.lock = threading.Lock()
        self.local = threading.local()

    def url(self, obj: Any) -> urllib.parse.SplitResult:
        now = time.monotonic()
        with self.lock:
            cached = self.urls.get(obj.path)
        if cached and cached[0] > now:
            return cached[1]
        bucket, _, key = obj.path.partition("/")
        params = {"Bucket": bucket, "Key": key, **self.extra}
        if obj.version_id:
            params["VersionId"] = obj.version_id
        url = urllib.parse.urlsplit(self.client.generate_presigned_url("get_object", Params=params,
                                                                        ExpiresIn=URL_LIFETIME))
        with self.lock:
            self.urls[obj.path] = (now + URL_LIFETIME - 300, url)
        return url

    def buffer(self) -> memoryview:
        """This thread's read buffer: blocks are views of it, valid until the next is asked for."""
        buf = getattr(self.local, "buffer", None)
        if buf is None:
            buf = self.local.buffer = memoryview(bytearray(READ_BLOCK))
        return buf

    def connection(self, url: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        conns = getattr(self.local, "conns", None)
        if conns is None:
            conns = self.local.conns = {}
        key = (url.scheme, url.netloc)
        conn = conns.get(key)
        if conn is None:
            if url.scheme == "https":
                context = ssl.create_default_context(cafile=self.verify if isinstance(self.verify, str) else None)
                if self.verify is False:
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
                conn = http.client.HTTPSConnection(url.netloc, timeout=60, context=context)
            else:
                conn = http.client.HTTPConnection(url.netloc, timeout=60)
            conns[key] = conn
        return conn

    def fetch(self, obj: Any, start: int, end: int) -> Iterator[bytes]:
        if self.presigned_ok:
            blocks = self._fetch_presigned(obj, start, end)
            try:
                first = next(blocks, None)  # the request and its status happen here
            except _Rejected:
                self.presigned_ok = False   # from now on every read goes through botocore
            else:
                if first is not None:
                    yield first
                    yield from blocks
                return
        yield from self.fallback(obj, start, end)

    def _fetch_presigned(self, obj: Any, start: int, end: int) -> Iterator[bytes]:
        url = self.url(obj)
        conn = self.connection(url)
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if obj.etag:
            headers["If-Match"] = f'"{obj.etag}"'
        try:
            conn.request("GET", f"{url.path}?{url.query}", headers=headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException):
            conn.close()  # the next request reconnects; the copier retries this range
            raise
        done = False
        try:
            if response.status not in (200, 206):
                body = response.read()
                code = _error_code(body)
                if response.status in (404, 412):
                    raise_for_status(obj, response.status, code)
                raise _Rejected(f"HTTP {response.status} {code}")
            if response.status == 200 and (start, end) != (0, obj.size):
                raise OSError(f"GET {obj.path}: the store ignored the byte range")
            yield from read_blocks(response, self.buffer())
            done = True
        finally:
            if not done or response.will_close:
                conn.close()


def read_blocks(response: http.client.HTTPResponse, view: memoryview) -> Iterator[memoryview]:
    """The body of ``response`` read into ``view`` block after block; each block is valid until
    the next is asked for (the buffer is reused: no allocation per block)."""
    while True:
        n = response.readinto(view)
        if not n:
            return
        yield view[:n]


def _error_code(body: bytes) -> str:
    start = body.find(b"<Code>")
    if start < 0:
        return ""
    stop = body.find(b"</Code>", start)
    return body[start + 6:stop].decode(errors="replace") if stop > 0 else ""
