"""Where objects come from: any fsspec filesystem, or S3 read natively through botocore.

Both give the engine the same three things: ``list()`` (SourceObjects), ``fetcher()``
(a thread-safe ``fetch(obj, start, end) -> byte blocks``) and ``head_func()`` (a HEAD
call for what verification needs to know about a multipart object; None if not S3).

For ``s3://`` the native source is used whenever the storage options are ones it
reproduces exactly (credentials, endpoint, region via client_kwargs, botocore config,
anon, profile, requester_pays; the same meaning as in s3fs). It lists with botocore and
reads with :mod:`operators.staging.s3read`, and so never imports s3fs, aiobotocore and
aiohttp: on the 2-core test machine those imports and the second client cost about a
quarter of a second of CPU per stage. Any other option (or ``DTRAIN_S3_CLIENT=s3fs``)
takes the s3fs path, which behaves the same.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Mapping

from operators.errors import SpecError
from operators.staging.errors import StagingError
from operators.staging.lister import SourceObject, build_objects, list_source

NATIVE_S3_OPTIONS = frozenset({
    "key", "secret", "token", "username", "password", "endpoint_url", "client_kwargs", "config_kwargs",
    "anon", "use_ssl", "requester_pays", "profile",
    # s3fs caching/tuning knobs that mean nothing to a one-shot listing:
    "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "default_block_size",
    "default_fill_cache", "default_cache_type", "max_concurrency", "cache_regions",
})


def open_source(source: str, storage_options: Mapping[str, Any] | None, workers: int):
    options = dict(storage_options or {})
    protocol = source.split("://", 1)[0] if "://" in source else "file"
    if (protocol in ("s3", "s3a") and set(options) <= NATIVE_S3_OPTIONS
            and os.environ.get("DTRAIN_S3_CLIENT", "") != "s3fs"):
        return NativeS3Source(source.split("://", 1)[1], options, workers)
    return FsspecSource(source, options, workers)


class FsspecSource:
    def __init__(self, source: str, options: dict, workers: int):
        import fsspec.core

        protocol = source.split("://", 1)[0] if "://" in source else "file"
        if protocol in ("s3", "s3a"):
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("max_pool_connections", max(10, workers * 2))
            options["config_kwargs"] = config
            options.setdefault("skip_instance_cache", True)  # fresh listing every stage
        try:
            self.fs, self.root = fsspec.core.url_to_fs(source, **options)
        except ImportError as e:
            raise StagingError(f"no filesystem for {source!r}: {e}") from e
        except (ValueError, TypeError) as e:
            raise SpecError("storage_options", "<not shown>", f"options the {protocol} filesystem accepts ({e})") from e
        self.fs.invalidate_cache()
        self.workers = workers

    def list(self) -> list[SourceObject]:
        return list_source(self.fs, self.root)

    def fetcher(self) -> Callable[[SourceObject, int, int], Iterator[bytes]]:
        fs = self.fs
        if "s3" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)):
            from operators.staging.s3read import make_fetcher
            fast = make_fetcher(s3fs_options(fs), self.workers)
            if fast is not None:
                return fast

        def fetch(obj: SourceObject, start: int, end: int):
            from operators.staging.s3read import BLOCK
            try:
                for pos in range(start, end, BLOCK):
                    yield fs.cat_file(obj.path, start=pos, end=min(end, pos + BLOCK))
            except FileNotFoundError as e:
                raise FileNotFoundError(f"{obj.path} vanished from the source during the stage") from e
        return fetch

    def head_func(self) -> Callable[..., dict] | None:
        if not hasattr(self.fs, "call_s3"):
            return None
        return lambda **kw: self.fs.call_s3("head_object", **kw)


def s3fs_options(fs: Any) -> dict[str, Any] | None:
    """The options an S3FileSystem was built with, or None if it holds an injected session."""
    if getattr(fs, "session", None) is not None and not getattr(fs, "_session_is_owned", True):
        return None
    options = {"key": fs.key, "secret": fs.secret, "token": fs.token, "endpoint_url": fs.endpoint_url,
               "client_kwargs": fs.client_kwargs, "config_kwargs": fs.config_kwargs, "anon": fs.anon,
               "use_ssl": fs.use_ssl, "requester_pays": fs.requester_pays}
    options.update(getattr(fs, "kwargs", {}) or {})
    return options


class NativeS3Source:
    def __init__(self, root: str, options: dict, workers: int):
        from operators.staging.s3read import build_client

        self.root = root.rstrip("/")
        self.bucket, _, self.prefix = self.root.partition("/")
        if not self.bucket:
            raise SpecError("source", f"s3://{root}", "s3://BUCKET[/PREFIX]")
        self.options = options
        self.workers = workers
        self.client, self.client_kwargs, self.config_kwargs = build_client(options, workers)
        self.extra = {"RequestPayer": "requester"} if options.get("requester_pays") else {}

    def list(self) -> list[SourceObject]:
        from botocore.exceptions import BotoCoreError, ClientError

        found: dict[str, dict[str, Any]] = {}
        kwargs = {"Bucket": self.bucket, **self.extra}
        if self.prefix:
            kwargs["Prefix"] = self.prefix + "/"
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(**kwargs):
                for item in page.get("Contents", ()):
                    found[f"{self.bucket}/{item['Key']}"] = {"ETag": item.get("ETag"), "size": item.get("Size", 0),
                                                             "LastModified": item.get("LastModified")}
            if not found and self.prefix:  # maybe the source names one object
                try:
                    head = self.client.head_object(Bucket=self.bucket, Key=self.prefix, **self.extra)
                    found[self.root] = {"ETag": head.get("ETag"), "size": head.get("ContentLength", 0)}
                except ClientError as e:
                    if _status(e) not in (403, 404):
                        raise
        except ClientError as e:
            code, status = _code(e), _status(e)
            if code == "NoSuchBucket" or status == 404:
                raise StagingError(f"source {self.root!r} does not exist (missing bucket or prefix): {code}") from e
            if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                                "ExpiredToken", "InvalidToken"):
                raise StagingError(f"access to source {self.root!r} denied: check the credentials and their "
                                   f"permissions ({code})") from e
            raise StagingError(f"cannot list source {self.root!r}: {code or status}: {e}") from e
        except BotoCoreError as e:  # no credentials, endpoint unreachable, ...
            raise StagingError(f"cannot list source {self.root!r}: {type(e).__name__}: {e}") from e
        return build_objects(self.root, found)

    def fetcher(self) -> Callable[[SourceObject, int, int], Iterator[bytes]]:
        from operators.staging.s3read import reader_for

        return reader_for(self.client, self.extra, self.client_kwargs, self.config_kwargs)

    def head_func(self) -> Callable[..., dict]:
        return lambda **kw: self.client.head_object(**kw, **self.extra)


def _code(e: Any) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: Any) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
