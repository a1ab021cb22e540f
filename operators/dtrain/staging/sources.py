"""Where objects come from: one :class:`Source` interface, three clients behind it.

The staging loop (:mod:`dtrain.staging.engine`) needs four things from a source and
nothing else: ``list()`` (the SourceObjects under it), ``fetcher()`` (a thread-safe
``fetch(obj, start, end) -> byte blocks``), ``head(obj)`` (what verification needs to
know about an object: size, ETag, stored checksum, part size) and ``close()``.
Every client implements exactly that:

- :class:`LeanS3Source` (:mod:`dtrain.staging.s3http`: SigV4 over ``http.client``, no
  botocore import at all), used for ``s3://`` whenever the options and AWS environment
  are plain enough for it to behave exactly as botocore would (explicit or environment
  credentials, no profile or config file, an endpoint it can address);
- :class:`NativeS3Source` (botocore lists; :mod:`dtrain.staging.s3read` reads), used for
  ``s3://`` whenever the storage options are ones it reproduces exactly (credentials,
  endpoint, region via client_kwargs, botocore config, anon, profile, requester_pays;
  the same meaning as in s3fs). It never imports s3fs, aiobotocore and aiohttp: on a
  2-core machine those imports and the second client cost about a quarter of a
  second of CPU per stage. ``DTRAIN_S3_CLIENT=botocore`` skips the lean source;
- :class:`FsspecSource` for any other option (or ``DTRAIN_S3_CLIENT=s3fs``) and every
  other protocol (file, memory, gcs, ...).
"""

from __future__ import annotations

import abc
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

from dtrain.errors import SpecError
from dtrain.staging.errors import StagingError
from dtrain.staging.lister import SourceObject, build_objects, list_source

# fetch(obj, start, end): bytes [start, end) of obj as blocks; a block may be a view of a
# buffer the next block reuses, so a caller consumes each block before asking for the next.
Fetch = Callable[[SourceObject, int, int], Iterator[Any]]

NATIVE_S3_OPTIONS = frozenset({
    "key", "secret", "token", "username", "password", "endpoint_url", "client_kwargs", "config_kwargs",
    "anon", "use_ssl", "requester_pays", "profile",
    # s3fs caching/tuning knobs that mean nothing to a one-shot listing:
    "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "default_block_size",
    "default_fill_cache", "default_cache_type", "max_concurrency", "cache_regions",
})
# Stored checksums a HEAD may report (botocore's field suffixes, lower-cased).
_HEAD_CHECKSUMS = ("crc32", "crc32c", "sha1", "sha256", "crc64nvme")


# user:password@ (the password may hold '/', as AWS secret keys do), and the values of query
# parameters that sign or authorize a request (presigned S3/GCS URLs, SAS tokens, ...).
_USERINFO = re.compile(r"(?<=://)([^/@]*|[^@]*:[^@]*)@")
_SECRET_QUERY = re.compile(r"(?i)[?&]([\w.-]*(?:signature|credential|token|sig|secret|password|key|keyid))=([^&#]*)")


def url_secrets(url: str) -> list[str]:
    """What in ``url`` must never reach a log or an error message, longest first: user:password
    whole and in the pieces a parser splits it into at ':' and '/' (a bucket name "KEY:SECRET-START"),
    and signing query values; each as written, percent-decoded and percent-encoded (libraries echo
    URLs either way). Pieces under 4 characters are left: replacing them would garble messages."""
    found = []
    m = _USERINFO.search(url)
    if m:
        found += [m.group(1), m.group(1).partition(":")[2], *re.split(r"[:/]", m.group(1))]
    found += [m.group(2) for m in _SECRET_QUERY.finditer(url)]
    unquote, quote = urllib.parse.unquote, urllib.parse.quote
    variants = {v for x in found for v in (x, unquote(x), quote(x, safe=""), quote(unquote(x), safe=""))}
    return sorted((v for v in variants if len(v) >= 4), key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every one of ``secrets`` replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def redact_url(url: str) -> str:
    """A URL fit for logs and errors: user:password and signing query values replaced by ``***``."""
    return scrub(url, url_secrets(url))


@dataclass(frozen=True)
class ObjectHead:
    """What a HEAD request says about one object (or one part of a multipart upload)."""

    size: int
    etag: str | None                                          # without quotes
    checksum_type: str | None = None                          # FULL_OBJECT / COMPOSITE, when the store says
    checksums: Mapping[str, str] = field(default_factory=dict)  # algo -> base64 value, as stored


class Source(abc.ABC):
    """One place objects are staged from. Thread-safe where noted; built by :func:`open_source`."""

    name: str  # the source as logs and errors may show it (no credentials)

    @abc.abstractmethod
    def list(self) -> list[SourceObject]:
        """Every object under the source, sorted, each key checked to stay inside a destination.

        StagingError for a missing, empty or forbidden source; UnsafeKeyError for a key that
        would escape the destination (raised before anything is copied)."""

    @abc.abstractmethod
    def fetcher(self) -> Fetch:
        """A thread-safe ``fetch(obj, start, end)``. It raises FileNotFoundError for a vanished
        object, PermissionError for a denied one, SourceChanged when the object no longer has
        the listed ETag; any other error is transient (the copier retries it)."""

    @abc.abstractmethod
    def head(self, obj: SourceObject, part_number: int | None = None) -> ObjectHead:
        """The object's size, ETag and stored full-object checksum; with ``part_number``, the size
        of that part of its multipart upload. FileNotFoundError for a missing object;
        NotImplementedError where the store cannot answer (no parts, no HEAD)."""

    def close(self) -> None:
        """Release connections held by the calling thread and the client; idempotent."""


def open_source(source: str, storage_options: Mapping[str, Any] | None, workers: int) -> Source:
    """The client for ``source``: lean S3, botocore S3 or fsspec (see the module docstring)."""
    options = dict(storage_options or {})
    protocol = source.split("://", 1)[0] if "://" in source else "file"
    forced = os.environ.get("DTRAIN_S3_CLIENT", "")
    if protocol in ("s3", "s3a") and forced != "s3fs" and set(options) <= NATIVE_S3_OPTIONS:
        root = source.split("://", 1)[1]
        if forced != "botocore":
            from dtrain.staging.s3http import bucket_supported, lean_settings

            settings = lean_settings(options)
            if settings is not None and bucket_supported(settings, root.partition("/")[0]):
                return LeanS3Source(root, settings)
        return NativeS3Source(root, options, workers)
    return FsspecSource(source, options, workers)


def head_from_botocore(answer: Mapping[str, Any]) -> ObjectHead:
    """An ObjectHead from a head_object answer in botocore's field names."""
    checksums = {algo: answer[f"Checksum{algo.upper()}"] for algo in _HEAD_CHECKSUMS
                 if answer.get(f"Checksum{algo.upper()}")}
    return ObjectHead(size=int(answer.get("ContentLength") or 0), etag=(answer.get("ETag") or "").strip('"') or None,
                      checksum_type=answer.get("ChecksumType"), checksums=checksums)


def _head_kwargs(obj: SourceObject, part_number: int | None) -> dict[str, Any]:
    """head_object arguments: a whole-object HEAD asks for stored checksums, a part HEAD for the part."""
    bucket, _, key = obj.path.partition("/")
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if part_number is None:
        kwargs["ChecksumMode"] = "ENABLED"
    else:
        kwargs["PartNumber"] = part_number
    return kwargs


class FsspecSource(Source):
    """Any fsspec filesystem; S3 through s3fs (bulk reads still go through botocore when they can)."""

    def __init__(self, source: str, options: dict, workers: int):
        import fsspec.core

        protocol = source.split("://", 1)[0] if "://" in source else "file"
        if protocol in ("s3", "s3a"):
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("max_pool_connections", max(10, workers * 2))
            options["config_kwargs"] = config
            options.setdefault("skip_instance_cache", True)  # fresh listing every stage
        try:
            self._fs, self._root = fsspec.core.url_to_fs(source, **options)
        except ImportError as e:
            raise StagingError(f"no filesystem for {redact_url(source)!r}: {e}") from e
        except (ValueError, TypeError) as e:
            raise SpecError("storage_options", "<not shown>", f"options the {protocol} filesystem accepts ({e})") from e
        self._fs.invalidate_cache()
        self._workers = workers
        self._s3 = hasattr(self._fs, "call_s3")
        self.name = redact_url(source)

    def list(self) -> list[SourceObject]:
        return list_source(self._fs, self._root)

    def fetcher(self) -> Fetch:
        if self._s3:
            from dtrain.staging.s3read import make_fetcher
            fast = make_fetcher(_s3fs_options(self._fs), self._workers)
            if fast is not None:
                return fast
        fs = self._fs

        def fetch(obj: SourceObject, start: int, end: int) -> Iterator[bytes]:
            from dtrain.staging.s3read import BLOCK
            try:
                for pos in range(start, end, BLOCK):
                    yield fs.cat_file(obj.path, start=pos, end=min(end, pos + BLOCK))
            except FileNotFoundError as e:
                raise FileNotFoundError(f"{obj.path} vanished from the source during the stage") from e
        return fetch

    def head(self, obj: SourceObject, part_number: int | None = None) -> ObjectHead:
        if self._s3:  # s3fs turns S3's 404/403 into FileNotFoundError/PermissionError
            return head_from_botocore(self._fs.call_s3("head_object", **_head_kwargs(obj, part_number)))
        if part_number is not None:
            raise NotImplementedError(f"{self.name}: no multipart parts on this filesystem")
        info = self._fs.info(obj.path)
        etag = info.get("ETag") or info.get("etag")
        return ObjectHead(size=int(info.get("size") or 0), etag=etag.strip('"') if isinstance(etag, str) else None)


def _s3fs_options(fs: Any) -> dict[str, Any] | None:
    """The options an S3FileSystem was built with, or None if it holds an injected session."""
    if getattr(fs, "session", None) is not None and not getattr(fs, "_session_is_owned", True):
        return None
    options = {"key": fs.key, "secret": fs.secret, "token": fs.token, "endpoint_url": fs.endpoint_url,
               "client_kwargs": fs.client_kwargs, "config_kwargs": fs.config_kwargs, "anon": fs.anon,
               "use_ssl": fs.use_ssl, "requester_pays": fs.requester_pays}
    options.update(getattr(fs, "kwargs", {}) or {})
    return options


class NativeS3Source(Source):
    """S3 listed and HEADed by botocore, read by :mod:`dtrain.staging.s3read`."""

    def __init__(self, root: str, options: dict, workers: int):
        from dtrain.staging.s3read import build_client

        self._root = root.rstrip("/")
        self._bucket, _, self._prefix = self._root.partition("/")
        if not self._bucket:
            raise SpecError("source", redact_url(f"s3://{root}"), "s3://BUCKET[/PREFIX]")
        self.name = redact_url(f"s3://{self._root}")
        self._client, self._client_kwargs, self._config_kwargs = build_client(options, workers)
        self._extra = {"RequestPayer": "requester"} if options.get("requester_pays") else {}

    def list(self) -> list[SourceObject]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            found = self._list_prefix()
            if not found and self._prefix:  # maybe the source names one object
                try:
                    head = self._client.head_object(Bucket=self._bucket, Key=self._prefix, **self._extra)
                    found[self._root] = {"ETag": head.get("ETag"), "size": head.get("ContentLength", 0)}
                except ClientError as e:
                    if _status(e) not in (403, 404):
                        raise
        except ClientError as e:
            raise listing_error(self._root, _code(e), _status(e), e) from e
        except BotoCoreError as e:  # no credentials, endpoint unreachable, ...
            raise StagingError(f"cannot list source {self._root!r}: {type(e).__name__}: {e}") from e
        return build_objects(self._root, found)

    def _list_prefix(self) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        kwargs = {"Bucket": self._bucket, **self._extra}
        if self._prefix:
            kwargs["Prefix"] = self._prefix + "/"
        for page in self._client.get_paginator("list_objects_v2").paginate(**kwargs):
            for item in page.get("Contents", ()):
                found[f"{self._bucket}/{item['Key']}"] = {"ETag": item.get("ETag"), "size": item.get("Size", 0),
                                                          "LastModified": item.get("LastModified")}
        return found

    def fetcher(self) -> Fetch:
        from dtrain.staging.s3read import reader_for

        return reader_for(self._client, self._extra, self._client_kwargs, self._config_kwargs)

    def head(self, obj: SourceObject, part_number: int | None = None) -> ObjectHead:
        from botocore.exceptions import ClientError

        from dtrain.staging.s3read import raise_for_status

        try:
            return head_from_botocore(self._client.head_object(**_head_kwargs(obj, part_number), **self._extra))
        except ClientError as e:
            raise_for_status(obj, _status(e), _code(e), e)
            raise

    def close(self) -> None:
        self._client.close()  # its connection pool; presigned readers' sockets close with their threads


def listing_error(root: str, code: str, status: int, e: BaseException) -> StagingError:
    """The error a failed listing of ``root`` raises, whichever client listed it."""
    if code == "NoSuchBucket" or status == 404:
        return StagingError(f"source {root!r} does not exist (missing bucket or prefix): {code}")
    if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                        "ExpiredToken", "InvalidToken"):
        return StagingError(f"access to source {root!r} denied: check the credentials and their permissions ({code})")
    return StagingError(f"cannot list source {root!r}: {code or status}: {e}")


class LeanS3Source(Source):
    """S3 listed, HEADed and read by :class:`dtrain.staging.s3http.S3Http` (no botocore)."""

    def __init__(self, root: str, settings: Any):
        from dtrain.staging.s3http import S3Http

        self._root = root.rstrip("/")
        self._bucket, _, self._prefix = self._root.partition("/")
        self.name = redact_url(f"s3://{self._root}")
        self._client = S3Http(settings, self._bucket)

    def list(self) -> list[SourceObject]:
        import http.client

        from dtrain.staging.s3http import S3ResponseError

        try:
            found = self._client.list(self._prefix + "/" if self._prefix else "")
            if not found and self._prefix:  # maybe the source names one object
                try:
                    head = self._client.head(Key=self._prefix)
                    found[self._root] = {"ETag": head["ETag"], "size": head["ContentLength"]}
                except S3ResponseError as e:
                    if e.status not in (403, 404):
                        raise
        except S3ResponseError as e:
            raise listing_error(self._root, e.code, e.status, e) from e
        except (OSError, http.client.HTTPException) as e:
            raise StagingError(f"cannot list source {self._root!r}: {type(e).__name__}: {e}") from e
        return build_objects(self._root, found)

    def fetcher(self) -> Fetch:
        return self._client.fetch

    def head(self, obj: SourceObject, part_number: int | None = None) -> ObjectHead:
        from dtrain.staging.s3http import S3ResponseError
        from dtrain.staging.s3read import raise_for_status

        try:
            return head_from_botocore(self._client.head(**_head_kwargs(obj, part_number)))
        except S3ResponseError as e:
            raise_for_status(obj, e.status, e.code, e)
            raise

    def close(self) -> None:
        self._client.close()


def _code(e: Any) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: Any) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
