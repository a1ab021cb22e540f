"""What "this download is correct" means for one object, and the hashing that proves it.

Kinds (chosen per object before its bytes are fetched):

- ``md5``: a single-part S3 ETag is the MD5 of the content; compare.
- ``mpu`` (the default for multipart objects): a multipart ETag ``md5(md5(part1)..md5(partN))-N``;
  with the upload's part size (learned with ``HEAD ?partNumber=1``) each part is hashed on its
  own and the ETag recomputed exactly. ``verify="strict"`` is the same as ``"auto"`` now that
  the default does this; it stays accepted so existing DAGs and scripts keep working.
- ``checksum``: the object's stored full-object checksum (CRC32, SHA1, SHA256); preferred
  over the multipart ETag when both exist (CRC32 costs a sixth of MD5).
- ``fingerprint``: no content reference available (no ETag, or a store that tells neither the
  part size nor a stored checksum); size is checked and the CRC32 of what was written is
  recorded in the manifest (so a later deep check can detect rot).
- ``size``: the user asked for size-only checks (e.g. SSE-KMS objects whose ETag is no MD5).

Bytes of one hash segment must be hashed in order while ranged parts land in any
order: :class:`SegmentHasher` hashes a part when it is next, and reads later parts
back from the file (page cache) once the gap before them is filled.
"""

from __future__ import annotations

import base64
import hashlib
import re
import threading
import zlib
from dataclasses import dataclass
from typing import Callable

from dtrain.staging.errors import VerifyError

MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
MPU_ETAG = re.compile(r"^([0-9a-f]{32})-(\d+)$")
CHECKSUM_ALGOS = ("sha256", "sha1", "crc32")
VERIFY_MODES = ("auto", "strict", "size")


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(4, "big")


def new_hash(algo: str):
    return _Crc32() if algo == "crc32" else hashlib.new(algo)


@dataclass
class VerifyPlan:
    kind: str                               # md5 | mpu | checksum | fingerprint | size
    algo: str                               # hash per segment: md5, sha256, sha1, crc32 ("" for size)
    segments: list[tuple[int, int]]         # [start, end) ranges hashed separately
    expected: str | None = None             # what the result must equal
    part_size: int = 0

    def checksum(self, actual: str | None) -> str | None:
        """The manifest's checksum string for a verified file."""
        if actual is None:
            return None
        if self.kind == "mpu":
            return f"s3etag:{self.part_size}:{actual}"
        return f"{self.algo}:{actual}"


def plan_verify(size: int, etag: str | None, mode: str = "auto", part_size: int | None = None,
                stored: tuple[str, str] | None = None) -> VerifyPlan:
    """Choose how to verify an object of ``size`` bytes from what the store told us about it.

    ``part_size``: the multipart upload's part size if known; ``stored``: (algo, base64 value)
    of a stored full-object checksum if the store returned one.
    """
    whole = [(0, size)]
    if mode == "size":
        return VerifyPlan("size", "", whole)
    if etag and MD5_ETAG.match(etag):
        return VerifyPlan("md5", "md5", whole, etag)
    if stored and stored[0] in CHECKSUM_ALGOS:
        return VerifyPlan("checksum", stored[0], whole, stored[1])
    m = MPU_ETAG.match(etag or "")
    if m and part_size and part_size > 0:
        parts = int(m.group(2))
        segments = [(s, min(s + part_size, size)) for s in range(0, size, part_size)] or whole
        if len(segments) == parts:
            return VerifyPlan("mpu", "md5", segments, etag, part_size)
    return VerifyPlan("fingerprint", "crc32", whole)


class SegmentHasher:
    """Hash the bytes of [start, end) in order although parts arrive out of order."""

    def __init__(self, start: int, end: int, algo: str):
        self.next = start
        self.end = end
        self.hash = new_hash(algo)
        self.pending: dict[int, int] = {}
        self.lock = threading.Lock()

    def add(self, start: int, end: int, data, read_back: Callable[[int, int], bytes] | None) -> None:
        """Hash ``data`` (bytes [start, end)) now if it is next; otherwise remember the range and
        ``read_back(start, end)`` it from what was written once the gap before it is filled."""
        with self.lock:
            if start != self.next:
                if read_back is None:
                    raise VerifyError("internal: out-of-order part without a file to read it back from")
                self.pending[start] = end  # bytes are in the file; read back when the gap fills
                return
            self.hash.update(data)
            self.next = end
            while self.next in self.pending:
                stop = self.pending.pop(self.next)
                self.hash.update(read_back(self.next, stop))
                self.next = stop

    def complete(self) -> bool:
        return self.next == self.end and not self.pending


def encode(algo: str, digest: bytes) -> str:
    """Digest as the store writes it: hex for MD5 ETags, base64 for S3 checksums."""
    return digest.hex() if algo == "md5" else base64.b64encode(digest).decode()


def finish(plan: VerifyPlan, hashers: list[SegmentHasher], what: str) -> str | None:
    """Compare the hashed content with the plan's expectation; return the manifest checksum.

    Raises VerifyError naming the object when the content is not what the store holds.
    """
    if plan.kind == "size":
        return None
    if not all(h.complete() for h in hashers):
        raise VerifyError(f"{what}: not every byte was hashed (short download)")
    digests = [h.hash.digest() for h in hashers]
    if plan.kind == "mpu":
        actual = f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"
    else:
        actual = encode(plan.algo, digests[0])
    if plan.expected is not None and actual != plan.expected:
        raise VerifyError(f"{what}: content does not match the store ({plan.kind} {plan.expected!r}, got {actual!r})")
    return plan.checksum(actual)


def hash_file(path: str, plan: VerifyPlan) -> str | None:
    """Recompute a staged file's checksum string (for deep checks of what is on disk)."""
    if plan.kind == "size":
        return None
    hashers = [SegmentHasher(s, e, plan.algo) for s, e in plan.segments]
    with open(path, "rb") as f:
        for h, (start, end) in zip(hashers, plan.segments):
            f.seek(start)
            pos = start
            while pos < end:
                data = f.read(min(end - pos, 1 << 24))
                if not data:
                    break
                h.add(pos, pos + len(data), data, None)
                pos += len(data)
    return finish(VerifyPlan(plan.kind, plan.algo, plan.segments, None, plan.part_size), hashers, path)
