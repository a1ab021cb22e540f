"""The Source contract, in the style of fsspec's ``tests/abstract``: one base class holds the
tests, one subclass per S3 client (lean, botocore, s3fs) runs them against moto's real S3
server. Every test goes through the :class:`dtrain.staging.sources.Source` interface only."""

from __future__ import annotations

import base64
import hashlib
import os
import zlib

import pytest

from dtrain.staging.errors import StagingError, UnsafeKeyError
from dtrain.staging.lister import SourceObject
from dtrain.staging.sources import FsspecSource, LeanS3Source, NativeS3Source, Source, open_source


class SourceContract:
    """What the staging loop relies on from every client. Subclasses set ``client`` (the
    DTRAIN_S3_CLIENT value that selects it) and ``kind`` (the class open_source must return)."""

    client = ""
    kind: type[Source] = Source

    @pytest.fixture
    def open(self, s3, monkeypatch):
        """open(prefix) -> this client's Source for s3://<test bucket>/<prefix>; closed after the test."""
        if self.client:
            monkeypatch.setenv("DTRAIN_S3_CLIENT", self.client)
        else:
            monkeypatch.delenv("DTRAIN_S3_CLIENT", raising=False)
        opened: list[Source] = []

        def make(url: str) -> Source:
            src = open_source(url, None, 4)
            assert type(src) is self.kind  # the client under test, not a fallback
            opened.append(src)
            return src

        yield make
        for src in opened:
            src.close()

    def test_list_gives_every_object_under_the_prefix_sorted_with_its_etag(self, s3, open):
        bodies = {"ds/b.bin": b"b" * 300, "ds/a/x.txt": b"x", "ds/a/y/z.bin": os.urandom(2000), "other/no": b"n"}
        s3.put_many(bodies)
        s3.put("ds/folder/", b"")  # a console "folder" marker: not a file
        src = open(s3.url("ds/"))
        assert src.name.rstrip("/") == f"s3://{s3.bucket}/ds"
        objects = src.list()
        assert [o.rel for o in objects] == ["a/x.txt", "a/y/z.bin", "b.bin"]
        for obj in objects:
            body = bodies["ds/" + obj.rel]
            assert obj.path == f"{s3.bucket}/ds/{obj.rel}"
            assert (obj.size, obj.etag, obj.token) == (len(body), hashlib.md5(body).hexdigest(),
                                                       f"etag:{hashlib.md5(body).hexdigest()}")

    def test_ranged_reads_return_exactly_the_bytes_asked_for(self, s3, open):
        body = os.urandom(3 * 1024 * 1024 + 5)  # more than one read block
        s3.put("ds/big.bin", body)
        src = open(s3.url("ds/"))
        [obj] = src.list()
        fetch = src.fetcher()
        # Copy each block before asking for the next: a block may be a view of a reused buffer.
        read = lambda start, end: b"".join(bytes(block) for block in fetch(obj, start, end))  # noqa: E731
        assert read(0, obj.size) == body
        assert read(7, 19) == body[7:19]
        assert read(1024 * 1024 - 3, 2 * 1024 * 1024 + 9) == body[1024 * 1024 - 3:2 * 1024 * 1024 + 9]
        assert read(obj.size - 1, obj.size) == body[-1:]

    def test_head_gives_size_etag_stored_checksum_and_part_size(self, s3, open):
        body = b"hello staging"
        s3.put("ds/one.bin", body)
        big = os.urandom(11 * 1024 * 1024)
        etag = s3.put_multipart("ds/mp.bin", big, part_size=5 * 1024 * 1024)
        src = open(s3.url("ds/"))
        one, mp = sorted(src.list(), key=lambda o: o.rel, reverse=True)
        head = src.head(one)
        assert (head.size, head.etag) == (len(body), hashlib.md5(body).hexdigest())
        # botocore stores a CRC32 with every upload; the HEAD asks for it.
        assert head.checksums.get("crc32") == base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
        assert mp.multipart and src.head(mp).etag == etag
        assert src.head(mp, part_number=1).size == 5 * 1024 * 1024  # what strict verification needs

    def test_an_unsafe_key_is_refused_by_the_listing(self, s3, open):
        s3.put("ds/fine.txt", b"fine")
        s3.put("ds/../escape.txt", b"evil")
        with pytest.raises(UnsafeKeyError, match="escape.txt"):
            open(s3.url("ds/")).list()

    def test_a_missing_object_is_file_not_found_and_a_missing_bucket_a_clear_error(self, s3, open):
        s3.put("ds/gone.bin", b"soon gone")
        src = open(s3.url("ds/"))
        [obj] = src.list()
        s3.client.delete_object(Bucket=s3.bucket, Key="ds/gone.bin")
        with pytest.raises(FileNotFoundError):
            b"".join(bytes(block) for block in src.fetcher()(obj, 0, obj.size))
        with pytest.raises(FileNotFoundError):
            src.head(obj)
        never = SourceObject(path=f"{s3.bucket}/ds/never.bin", rel="never.bin", size=1, etag=None, token="unknown")
        with pytest.raises(FileNotFoundError):
            src.head(never)
        with pytest.raises(StagingError, match="does not exist"):
            open("s3://no-such-bucket-dtrain/ds/").list()


class TestLeanS3Source(SourceContract):
    client = ""  # the default with plain credentials
    kind = LeanS3Source


class TestNativeS3Source(SourceContract):
    client = "botocore"
    kind = NativeS3Source


class TestFsspecSource(SourceContract):
    client = "s3fs"
    kind = FsspecSource
