"""List the source and turn each object key into a safe relative destination path.

A listing entry keeps what incremental staging compares (size, ETag or another
change token, version id) and nothing secret.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from dtrain.staging.errors import StagingError, UnsafeKeyError

# Names staging keeps for itself inside the destination; no source key may use them.
RESERVED_PREFIX = ".dtrain-"


@dataclass(frozen=True)
class SourceObject:
    path: str          # path as the source filesystem names it (bucket/key for s3)
    rel: str           # relative POSIX path under the destination
    size: int
    etag: str | None   # S3 ETag without quotes, or None
    token: str         # change token: the ETag, else version/mtime; equal token + size = unchanged
    version_id: str | None = None

    @property
    def multipart(self) -> bool:
        return bool(self.etag) and "-" in self.etag


def safe_relpath(key: str) -> str:
    """``key`` as a relative path that stays inside the destination, or UnsafeKeyError naming it."""
    if not key:
        raise UnsafeKeyError(key, "empty key")
    if "\x00" in key:
        raise UnsafeKeyError(key, "contains a NUL byte")
    if key.startswith("/"):
        raise UnsafeKeyError(key, "absolute path")
    parts = key.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise UnsafeKeyError(key, f"path component {part!r} is not allowed (would escape or alias the destination)")
        if part.startswith(RESERVED_PREFIX):
            raise UnsafeKeyError(key, f"names starting with {RESERVED_PREFIX!r} are reserved for staging's own files")
        if len(part.encode()) > 255:
            raise UnsafeKeyError(key, "a path component is longer than 255 bytes")
    return "/".join(parts)


def _token(info: dict[str, Any]) -> tuple[str | None, str | None, str]:
    etag = info.get("ETag") or info.get("etag")
    etag = etag.strip('"') if isinstance(etag, str) else None
    version = info.get("VersionId") or info.get("version_id")
    if etag:
        return etag, version, f"etag:{etag}"
    if version:
        return None, version, f"version:{version}"
    for name in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(name)
        if value is not None:
            if hasattr(value, "timestamp"):
                value = value.timestamp()
            return None, None, f"{name}:{value!r}"
    return None, None, "unknown"


def list_source(fs: Any, root: str) -> list[SourceObject]:
    """Every object under ``root`` (a directory-like prefix) of an fsspec filesystem, sorted.

    Raises StagingError for a missing source, access denied, or an empty source; UnsafeKeyError
    for a key that would escape the destination (checked for every key before anything is copied).
    """
    root = root.rstrip("/")
    try:
        found = fs.find(root, detail=True, withdirs=False)
    except FileNotFoundError as e:
        raise StagingError(f"source {root!r} does not exist (missing bucket or prefix): {e}") from e
    except PermissionError as e:
        raise StagingError(f"access to source {root!r} denied: check the credentials and their permissions ({e})") from e
    except Exception as e:  # botocore credential errors and the like carry no common base
        raise StagingError(f"cannot list source {root!r}: {type(e).__name__}: {e}") from e
    return build_objects(root, found)


def build_objects(root: str, found: dict[str, dict[str, Any]]) -> list[SourceObject]:
    """SourceObjects from ``{path: info}`` listed under ``root``; safe relative paths, sorted.

    Directory markers (zero-byte keys ending in ``/``) are skipped, as ``aws s3 sync`` does.
    """
    objects: list[SourceObject] = []
    prefix = root + "/"
    for path, info in found.items():
        if info.get("type", "file") != "file":
            continue
        if path == root:  # the source is a single object: stage it under its own name
            key = posixpath.basename(path)
        elif path.startswith(prefix):
            key = path[len(prefix):]
        else:
            raise UnsafeKeyError(path, f"listed outside the source prefix {prefix!r}")
        size = int(info.get("size") or info.get("Size") or 0)
        if key.endswith("/"):
            if size == 0:
                continue  # directory marker
            raise UnsafeKeyError(key, "a non-empty object whose key ends with '/' cannot be a file")
        etag, version, token = _token(info)
        objects.append(SourceObject(path=path, rel=safe_relpath(key), size=size, etag=etag,
                                    token=token, version_id=version))
    if not objects:
        raise StagingError(f"source {root!r} is empty: no objects to stage")
    objects.sort(key=lambda o: o.rel)
    _refuse_file_dir_clash(objects)
    return objects


def _refuse_file_dir_clash(objects: list[SourceObject]) -> None:
    """``a`` and ``a/b`` cannot both be files on a POSIX filesystem; say so before copying."""
    names = {o.rel for o in objects}
    for o in objects:
        parent = posixpath.dirname(o.rel)
        while parent:
            if parent in names:
                raise UnsafeKeyError(o.rel, f"its directory {parent!r} is also an object; both cannot exist on a filesystem")
            parent = posixpath.dirname(parent)
