"""Ranged S3 reads on worker threads through botocore's own (urllib3) connection pool.

Listing and metadata go through s3fs. Bulk bytes do not: s3fs reads every response
body on its single asyncio thread (aiohttp, 64 KiB flow-control steps), which caps a
whole stage at one core. A botocore client configured exactly as the S3FileSystem is
(same credentials, endpoint, region, profile, config) lets each worker thread read
its own socket, with the GIL released while it waits. Every range is requested with
``If-Match: <ETag>`` so parts of one file can never come from two versions of the object.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from operators.staging.errors import StagingError


# Bytes held per worker: a range is streamed to disk in blocks of this size.
BLOCK = 8 * 1024 * 1024


class SourceChanged(StagingError):
    """The object changed between the listing and the read; a rerun picks up the new version."""


def make_fetcher(fs: Any, workers: int) -> Callable[[Any, int, int], Iterator[bytes]] | None:
    """A thread-safe ``fetch(obj, start, end) -> iterator of byte blocks`` for an S3FileSystem, or None.

    None when the filesystem was built in a way this cannot reproduce (an injected session);
    the caller then reads through s3fs.
    """
    if getattr(fs, "session", None) is not None and not getattr(fs, "_session_is_owned", True):
        return None
    try:
        import botocore.config
        import botocore.session
        from botocore.exceptions import ClientError
    except ImportError:
        return None
    client_kwargs = dict(getattr(fs, "client_kwargs", {}) or {})
    init = {"aws_access_key_id": fs.key, "aws_secret_access_key": fs.secret, "aws_session_token": fs.token,
            "endpoint_url": fs.endpoint_url}
    init = {k: v for k, v in init.items() if v is not None and k not in client_kwargs}
    config_kwargs = dict(getattr(fs, "config_kwargs", {}) or {})
    config_kwargs["max_pool_connections"] = max(int(config_kwargs.get("max_pool_connections") or 10), workers + 4)
    # Our own MD5/ETag verification covers the content; skip botocore's extra CRC pass.
    config_kwargs.setdefault("response_checksum_validation", "when_required")
    if getattr(fs, "anon", False):
        from botocore import UNSIGNED
        config_kwargs["signature_version"] = UNSIGNED
        for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
            init.pop(k, None)
            client_kwargs.pop(k, None)
    if "use_ssl" not in client_kwargs:
        init["use_ssl"] = getattr(fs, "use_ssl", True)
    try:
        session = botocore.session.Session(**(getattr(fs, "kwargs", {}) or {}))
        client = session.create_client("s3", config=botocore.config.Config(**config_kwargs), **init, **client_kwargs)
    except Exception:  # noqa: BLE001 - options botocore does not take: fall back to s3fs reads
        return None
    extra = dict(getattr(fs, "req_kw", {}) or {})

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
            error = e.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("NoSuchKey", "NoSuchBucket", "404") or status == 404:
                raise FileNotFoundError(f"{obj.path} vanished from the source during the stage") from e
            if code in ("PreconditionFailed",) or status == 412:
                raise SourceChanged(f"{obj.path} changed during the stage (ETag is no longer {obj.etag}); "
                                    "rerun to stage the new version") from e
            if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise PermissionError(f"access to {obj.path} denied ({code})") from e
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
