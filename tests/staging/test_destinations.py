"""A non-POSIX (fsspec) destination goes through the same staging loop as a POSIX directory:
retries after transient faults, progress, cancellation, verification, the lock, the manifest
last. Sources are moto's real S3 server behind the fault-injecting proxy (conftest)."""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid

import fsspec
import pytest

from dtrain.staging import manifest as M
from dtrain.staging.engine import open_destination, stage
from dtrain.staging.errors import StagingCancelled, StagingError
from dtrain.staging.fsspecdest import FsspecDestination

from .conftest import wait_for


@pytest.fixture(params=["memory", "s3"])
def fsspec_dest(request, tmp_path, s3):
    """(URL of a fresh fsspec destination, its filesystem, its root path): memory:// (an object
    store's semantics: no offsets) or s3:// (s3fs) on the moto server, checked through its own
    client that talks to moto directly (not through a test's proxy). local:// and file:// are
    POSIX destinations (tested below and in test_engine/test_safety)."""
    if request.param == "s3":
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=s3.endpoint, key="testing", secret="testing",
                               skip_instance_cache=True, use_listings_cache=False)
        yield f"s3://{s3.bucket}/staged/v1", fs, f"{s3.bucket}/staged/v1"
    elif request.param == "memory":
        fs = fsspec.filesystem("memory")
        root = f"/dtrain-test-{uuid.uuid4().hex[:12]}/dest"
        yield f"memory://{root}", fs, root
        if fs.exists(root.rsplit("/", 1)[0]):
            fs.rm(root.rsplit("/", 1)[0], recursive=True)


def files(fs, root: str) -> dict[str, bytes]:
    """Every file under root (staging's own names included) -> its bytes."""
    return {p[len(root) + 1:]: fs.cat_file(p) for p in fs.find(root) if p.startswith(root + "/")}


def test_fsspec_url_is_an_fsspec_destination_and_a_path_is_posix(tmp_path):
    assert isinstance(open_destination("memory://x/y"), FsspecDestination)
    assert not isinstance(open_destination(str(tmp_path)), FsspecDestination)
    assert not isinstance(open_destination(f"file://{tmp_path}"), FsspecDestination)
    assert not isinstance(open_destination(f"local://{tmp_path}"), FsspecDestination)


def test_fsspec_destination_retries_a_corrupt_and_a_cut_download(s3, proxy, fsspec_dest, monkeypatch, caplog):
    endpoint, faults = proxy
    url, fs, root = fsspec_dest
    small, big = os.urandom(300_000), os.urandom(2 * 1024 * 1024 + 11)
    s3.put_many({"p/small.bin": small, "p/d/big.bin": big, "p/ok.txt": b"ok"})
    faults.corrupt["small.bin"] = 1   # one byte flipped: the MD5 check fails, the file is refetched
    faults.truncate["big.bin"] = 1    # body cut in half, connection dropped: the range resumes
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with caplog.at_level(logging.DEBUG, logger="dtrain.staging"):
        result = stage(s3.url("p/"), url, workers=2, part_size="256KiB", retries=1)
    assert files(fs, root) == {"small.bin": small, "d/big.bin": big, "ok.txt": b"ok",
                               M.MANIFEST_NAME: fs.cat_file(f"{root}/{M.MANIFEST_NAME}")}  # no temp file left
    assert sum(g.endswith("small.bin") for g in faults.gets) == 2
    assert sum(g.endswith("big.bin") for g in faults.gets) == 2  # one GET for the file, one to resume it
    assert "refetching small.bin after" in caplog.text and "resuming d/big.bin at byte" in caplog.text
    doc = json.loads(fs.cat_file(f"{root}/{M.MANIFEST_NAME}"))
    assert doc["complete"] and set(doc["files"]) == {"small.bin", "d/big.bin", "ok.txt"}
    assert (result.fetched, result.destination) == (3, url)
    faults.gets.clear()
    assert stage(s3.url("p/"), url).fetched == 0  # incremental: nothing re-read from the source
    assert [g for g in faults.gets if f"{s3.bucket}/p/" in g] == []


def test_fsspec_destination_fails_without_retries_and_writes_no_manifest(s3, proxy, fsspec_dest, monkeypatch):
    endpoint, faults = proxy
    url, fs, root = fsspec_dest
    s3.put_many({"p/bad.bin": os.urandom(5000), "p/good.bin": b"g" * 10})
    faults.corrupt["bad.bin"] = 100
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(StagingError, match="bad.bin.*does not match"):
        stage(s3.url("p/"), url, retries=2)
    assert sum(g.endswith("bad.bin") for g in faults.gets) == 3  # the first try and two retries
    assert files(fs, root) == {"good.bin": b"g" * 10}  # no manifest, no temp file, nothing at bad.bin


def test_fsspec_destination_reports_progress(s3, fsspec_dest, caplog):
    url, _fs, _root = fsspec_dest
    s3.put_many({f"p/{i}": os.urandom(200_000) for i in range(20)})
    with caplog.at_level(logging.INFO, logger="dtrain.staging"):
        stage(s3.url("p/"), url, progress_interval=0.001, workers=2)
    assert "staging progress:" in caplog.text and "ETA" in caplog.text and "fetched 20, skipped 0" in caplog.text


def test_fsspec_destination_cancels_mid_file_and_leaves_no_temp_file(s3, proxy, fsspec_dest, monkeypatch):
    endpoint, faults = proxy
    url, fs, root = fsspec_dest
    s3.put_many({f"p/{i}.bin": os.urandom(3 * 1024 * 1024) for i in range(4)})
    faults.bytes_per_second = 4_000_000  # a file (3 read blocks) takes ~0.8 s: the cancel lands mid-file
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    cancel = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            stage(s3.url("p/"), url, workers=2, cancel=cancel)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: faults.gets, interval=0.02, what="a file being copied")
    cancel.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], StagingCancelled)
    assert files(fs, root) == {}  # nothing landed, no temp file, no manifest


def test_fsspec_destination_is_locked_while_a_stage_writes_it(s3, fsspec_dest):
    url, _fs, _root = fsspec_dest
    s3.put("p/x", b"x")
    with FsspecDestination(url).lock():
        with pytest.raises(StagingError, match="another stage"):
            stage(s3.url("p/"), url)
    assert stage(s3.url("p/"), url).fetched == 1


@pytest.mark.parametrize("scheme", ["local://", "file://"])
def test_local_url_destination_refuses_a_symlink_out(s3, tmp_path, scheme):
    s3.put("p/sub/x.txt", b"x")
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (dest / "sub").symlink_to(outside)
    with pytest.raises(StagingError, match="outside the destination"):
        stage(s3.url("p/"), f"{scheme}{dest}")
    assert list(outside.iterdir()) == []
