"""Where objects come from: any fsspec filesystem, or S3 read natively through botocore.

Both give the engine the same three things: ``list()`` (SourceObjects), ``fetcher()``
(a thread-safe ``fetch(obj, start, end) -> byte blocks``) and ``head_func()`` (a HEAD
call for what verification needs to know about a multipart object; None if not S3).

For ``s3://`` the lean source (:mod:`operators.staging.s3http`: SigV4 over ``http.client``,
no botocore import at all) is used whenever the options and AWS environment are plain
enough for it to behave exactly as botocore would (explicit or environment credentials,
no profile or config file, an endpoint it can address). Otherwise the native source is
used whenever the storage options are ones it
reproduces exactly (credentials, endpoint, region via client_kwargs, botocore config,
anon, profile, requester_pays; the same meaning as in s3fs). It lists with botocore and
reads with :mod:`operators.staging.s3read`, and so never imports s3fs, aiobotocore and
aiohttp: on the 2-core test machine those imports and the second client cost about a
quarter of a second of CPU per stage. Any other option (or ``DTRAIN_S3_CLIENT=s3fs``)
takes the s3fs path, which behaves the same; ``DTRAIN_S3_CLIENT=botocore`` skips the
lean source.
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
    forced = os.environ.get("DTRAIN_S3_CLIENT", "")
    if protocol in ("s3", "s3a") and forced != "s3fs" and set(options) <= NATIVE_S3_OPTIONS:
        root = source.split("://", 1)[1]
        if forced != "botocore":
            from operators.staging.s3http import bucket_supported, lean_settings

            settings = lean_settings(options)
            if settings is not None and bucket_supported(settings, root.partition("/")[0]):
                return LeanS3Source(root, settings)
        return NativeS3Source(root, options, workers)
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
            raise listing_error(self.root, _code(e), _status(e), e) from e
        except BotoCoreError as e:  # no credentials, endpoint unreachable, ...
            raise StagingError(f"cannot list source {self.root!r}: {type(e).__name__}: {e}") from e
        return build_objects(self.root, found)

    def fetcher(self) -> Callable[[SourceObject, int, int], Iterator[bytes]]:
        from operators.staging.s3read import reader_for

        return reader_for(self.client, self.extra, self.client_kwargs, self.config_kwargs)

    def head_func(self) -> Callable[..., dict]:
        return lambda **kw: self.client.head_object(**kw, **self.extra)


def listing_error(root: str, code: str, status: int, e: BaseException) -> StagingError:
    """The error a failed listing of ``root`` raises, whichever client listed it."""
    if code == "NoSuchBucket" or status == 404:
        return StagingError(f"source {root!r} does not exist (missing bucket or prefix): {code}")
    if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                        "ExpiredToken", "InvalidToken"):
        return StagingError(f"access to source {root!r} denied: check the credentials and their permissions ({code})")
    return StagingError(f"cannot list source {root!r}: {code or status}: {e}")


class LeanS3Source:
    """S3 listed and read by :class:`operators.staging.s3http.S3Http` (no botocore)."""

    def __init__(self, root: str, settings: Any):
        from operators.staging.s3http import S3Http

        self.root = root.rstrip("/")
        self.bucket, _, self.prefix = self.root.partition("/")
        self.client = S3Http(settings, self.bucket)

    def list(self) -> list[SourceObject]:
        import http.client

        from operators.staging.s3http import S3ResponseError

        try:
            found = self.client.list(self.prefix + "/" if self.prefix else "")
            if not found and self.prefix:  # maybe the source names one object
                try:
                    head = self.client.head(Key=self.prefix)
                    found[self.root] = {"ETag": head["ETag"], "size": head["ContentLength"]}
                except S3ResponseError as e:
                    if e.status not in (403, 404):
                        raise
        except S3ResponseError as e:
            raise listing_error(self.root, e.code, e.status, e) from e
        except (OSError, http.client.HTTPException) as e:
            raise StagingError(f"cannot list source {self.root!r}: {type(e).__name__}: {e}") from e
        return build_objects(self.root, found)

    def fetcher(self) -> Callable[[SourceObject, int, int], Iterator[bytes]]:
        return self.client.fetch

    def head_func(self) -> Callable[..., dict]:
        return self.client.head


def _code(e: Any) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: Any) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
