"""Findings of an adversarial review of staging, each reproduced exactly: symlinks planted in the
destination, local:// destinations, unwritable destinations, exit statuses of bad input,
secrets in URLs, and multipart objects verified by default. Real moto S3 server (conftest)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import traceback
import uuid

import pytest

from dtrain.staging import manifest as M
from dtrain.staging.engine import stage
from dtrain.staging.errors import DestinationError, StagingError
from dtrain.staging.posixdest import PosixTempFile

DTRAIN = os.path.join(os.path.dirname(sys.executable), "dtrain")


def run(argv, timeout=120):
    return subprocess.run([DTRAIN, *argv], capture_output=True, text=True, timeout=timeout)


def outside_dir(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "existing").write_bytes(b"untouched")
    return outside


def error_of(call, *args, **kwargs) -> BaseException | None:
    """The exception ``call`` raises, or None: a test checks what happened outside DST first."""
    try:
        call(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - asserted by the caller
        return e
    return None


def untouched(outside) -> bool:
    return sorted(os.listdir(outside)) == ["existing"] and (outside / "existing").read_bytes() == b"untouched"


# --- 1. symlinks (and hard links) planted at staging's own files ------------------------------

@pytest.mark.parametrize("name,link,target", [
    (M.LOCK_NAME, "symlink", "missing"), (M.LOCK_NAME, "symlink", "existing"),
    (M.JOURNAL_NAME, "symlink", "missing"), (M.JOURNAL_NAME, "symlink", "existing"),
    (M.MANIFEST_NAME, "symlink", "missing"), (M.MANIFEST_NAME, "symlink", "existing"),
    (M.JOURNAL_NAME, "hardlink", "existing"),
])
def test_link_planted_at_a_bookkeeping_name_is_refused_not_followed(s3, tmp_path, name, link, target):
    """DST/<staging's file> -> a file outside DST: the stage fails naming the path, and the file
    outside is neither created nor written (it was appended to / created before the fix)."""
    s3.put_many({"p/a.bin": b"a" * 100, "p/d/b.bin": b"b" * 10})
    dest, outside = tmp_path / "dest", outside_dir(tmp_path)
    dest.mkdir()
    if link == "symlink":
        (dest / name).symlink_to(outside / target)
    else:
        os.link(outside / target, dest / name)
    error = error_of(stage, s3.url("p/"), str(dest))
    assert untouched(outside)
    assert isinstance(error, DestinationError) and str(dest / name) in str(error) and "remove it" in str(error)


def test_temp_files_are_new_files_never_written_through_a_planted_link(tmp_path, monkeypatch):
    """The manifest's temp file had a predictable name (.dtrain-tmp-<pid>-<name>) opened with
    O_TRUNC, so a symlink planted there was written through. Temp names are now unpredictable and
    created with O_EXCL|O_NOFOLLOW; uuid4 is pinned here to plant a link at the new name too."""
    pinned = uuid.UUID(int=7)
    monkeypatch.setattr(uuid, "uuid4", lambda: pinned)
    dest, outside = tmp_path / "dest", outside_dir(tmp_path)
    dest.mkdir()
    for tmp in (f"{M.TMP_PREFIX}{os.getpid()}-{M.MANIFEST_NAME}", f"{M.TMP_PREFIX}{pinned.hex[:16]}"):
        (dest / tmp).symlink_to(outside / tmp)
    error = error_of(M.write, str(dest), "s3://b/p", {})
    assert untouched(outside) and not (dest / M.MANIFEST_NAME).exists()
    assert isinstance(error, DestinationError) and "symbolic link" in str(error)
    with pytest.raises(DestinationError, match="symbolic link"):
        PosixTempFile(str(dest / "x.bin"), 10, preallocate=False, fsync=False)
    assert untouched(outside)


def test_stray_temp_symlink_is_removed_by_the_scan_not_followed(s3, tmp_path):
    s3.put("p/a.bin", b"a")
    dest, outside = tmp_path / "dest", outside_dir(tmp_path)
    dest.mkdir()
    (dest / f"{M.TMP_PREFIX}stray").symlink_to(outside / "existing")
    assert stage(s3.url("p/"), str(dest)).fetched == 1
    assert (outside / "existing").read_bytes() == b"untouched"
    assert not os.path.lexists(dest / f"{M.TMP_PREFIX}stray")


# --- 2. no directory made through a symlinked directory ---------------------------------------

@pytest.mark.parametrize("scheme", ["", "local://", "file://"])
@pytest.mark.parametrize("link_at", ["sub", "a/deep"])
def test_no_directory_is_made_under_a_symlinked_directory(s3, tmp_path, scheme, link_at):
    """DST/sub -> outside and a key sub/x/file: refused before any directory is made, for every
    key (not even DST/a for the key a/b.txt), and nothing appears outside (the directory x did)."""
    s3.put_many({f"p/{link_at}/x/file": b"f", "p/a/b.txt": b"b", "p/top.txt": b"t"})
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    outside.mkdir()
    (dest / os.path.dirname(link_at)).mkdir(parents=True, exist_ok=True)
    (dest / link_at).symlink_to(outside)
    before = sorted(os.listdir(dest))
    error = error_of(stage, s3.url("p/"), f"{scheme}{dest}")
    assert list(outside.iterdir()) == []
    assert sorted(set(os.listdir(dest)) - {M.LOCK_NAME}) == before
    assert isinstance(error, StagingError) and str(dest / link_at) in str(error)
    assert "symbolic link" in str(error) and "outside the destination" in str(error)
    assert not (dest / "top.txt").exists()


# --- 3. local:// and file:// destinations are POSIX destinations ------------------------------

@pytest.mark.parametrize("scheme", ["local://", "file://"])
def test_local_url_without_a_path_is_refused_not_the_working_directory(tmp_path, monkeypatch, scheme):
    from dtrain.errors import SpecError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError, match="a directory path after"):
        stage(f"file://{tmp_path}", scheme)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("scheme", ["local://", "file://"])
def test_local_url_destination_stages_nested_keys(s3, tmp_path, scheme):
    items = {"p/a.bin": b"a" * 10, "p/x/y/z/deep.bin": os.urandom(70_000), "p/x/b.txt": b"b"}
    s3.put_many(items)
    dest = tmp_path / "dest"
    result = stage(s3.url("p/"), f"{scheme}{dest}", part_size="256KiB")
    for key, body in items.items():
        assert (dest / key[2:]).read_bytes() == body
    assert result.fetched == 3 and result.destination == str(dest)
    assert set(json.loads((dest / M.MANIFEST_NAME).read_text())["files"]) == {k[2:] for k in items}
    assert not (dest / M.JOURNAL_NAME).exists()
    assert stage(s3.url("p/"), f"{scheme}{dest}").fetched == 0


HOLD_LOCK = ("import fcntl, os, sys\n"
             "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
             "fcntl.flock(fd, fcntl.LOCK_EX)\n"
             "print('held', flush=True)\n"
             "sys.stdin.read()\n")


@pytest.mark.parametrize("scheme", ["local://", "file://"])
def test_local_url_destination_is_locked_against_another_process(s3, tmp_path, scheme):
    """Another process holds the destination's flock (as a running `dtrain stage` does): a stage
    into the same directory named by a local:// URL is refused (it only had a lock per process)."""
    s3.put("p/x", b"x")
    dest = tmp_path / "dest"
    dest.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(dest / M.LOCK_NAME)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StagingError, match="another stage"):
            stage(s3.url("p/"), f"{scheme}{dest}")
        assert not (dest / "x").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
        holder.stdout.close()
    assert stage(s3.url("p/"), f"{scheme}{dest}").fetched == 1


# --- 4, 5, 8. bad input: exit status 2, a clear message, nothing created ------------------------

@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_destination_that_cannot_be_written_exits_2_naming_it(tmp_path, where):
    """Run as root, a read-only directory is still writable, so these are destinations nobody can
    write: a path under a regular file (ENOTDIR; exit 1 before the fix), and /proc/self, an
    existing directory where no file can be created (a raw OSError traceback before the fix)."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "x.bin").write_bytes(b"x")
    if where == "proc":
        dest = "/proc/self"
    else:
        (tmp_path / "file").write_bytes(b"")
        dest = str(tmp_path / "file" / "dest")
    before = sorted(os.listdir(tmp_path))
    proc = run(["stage", f"file://{src}", dest])
    assert proc.returncode == 2, proc.stderr
    assert f"destination {dest!r} cannot be written" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("key,extra,expected", [
    ("p/../evil", [], "refusing source key '../evil'"),
    ("p//abs.txt", [], "refusing source key '/abs.txt'"),
    ("p/fine2", ["--workers", "0"], "workers=0"),
    ("p/fine2", ["--part-size", "lots"], "part_size='lots'"),
])
def test_bad_input_exits_2_before_anything_is_created(s3, tmp_path, key, extra, expected):
    """A refused key exited 1 after creating DST and its lock file; every refusal of input now
    exits 2 with a message naming the value, and the destination does not exist afterwards."""
    s3.put_many({"p/fine": b"f", key: b"x"})
    dest = tmp_path / "dest"
    proc = run(["stage", s3.url("p/"), str(dest), *extra])
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(tmp_path) == []


# --- 6. secrets inside a source URL ------------------------------------------------------------

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzSECRET"
SIGNATURE = "5d672d79c15b13162d9279b0855cfba6789a8edb4c82c400e06b5924a6f2b5d7"
SECRET_URLS = {
    "inline": f"s3://AKIDINLINE:{SECRET}@no-such-bucket-dtrain/p/",
    "query": ("s3://no-such-bucket-dtrain/p/?X-Amz-Credential=AKIDQUERY%2F20240101%2Fus-east-1%2Fs3%2Faws4_request"
              f"&X-Amz-Signature={SIGNATURE}"),
}
SECRET_PARTS = ("AKIDINLINE", SECRET, SECRET.split("/")[1], "AKIDQUERY", SIGNATURE)


def leaked(text: str) -> list[str]:
    return [part for part in SECRET_PARTS if part in text]


@pytest.mark.parametrize("client", ["lean", "botocore", "s3fs"])
@pytest.mark.parametrize("form", sorted(SECRET_URLS))
def test_secrets_in_a_source_url_never_reach_the_error(s3, tmp_path, monkeypatch, form, client):
    """A stage from a URL with inline credentials or a signed query fails (no such bucket): the
    message, the whole chain of causes a traceback would print, and the CLI's stderr hold none
    of the secret (botocore echoed the bucket name and request URL before the fix)."""
    if client != "lean":
        monkeypatch.setenv("DTRAIN_S3_CLIENT", client)
    url = SECRET_URLS[form]
    with pytest.raises(StagingError) as info:
        stage(url, str(tmp_path / "dest"))
    assert leaked("".join(traceback.format_exception(info.value))) == []
    assert "no-such-bucket-dtrain" in str(info.value)
    proc = run(["stage", url, str(tmp_path / "dest")])
    assert proc.returncode != 0 and "no-such-bucket-dtrain" in proc.stderr
    assert leaked(proc.stderr + proc.stdout) == [] and "Traceback" not in proc.stderr


def test_operator_log_xcom_and_manifest_carry_no_url_secret(s3, tmp_path, capfd, caplog):
    """A signed-looking query in an S3 URL is a prefix S3 can list (here, one with an object
    under it): the stage succeeds, and neither the task log (which named the source unredacted),
    nor the XCom, nor the manifest (both kept the signature) shows it."""
    from dtrain.staging.operator import StageToSharedFSOperator

    s3.put(f"p/?X-Amz-Signature={SIGNATURE}/a.bin", b"a")
    op = StageToSharedFSOperator(task_id="s", source=s3.url(f"p/?X-Amz-Signature={SIGNATURE}/"),
                                 destination=str(tmp_path / "fsx"), dataset_version="v1", aws_conn_id=None)
    with caplog.at_level(logging.DEBUG):
        out = op.execute({})
    assert out["fetched"] == 1 and "X-Amz-Signature=***" in out["source"]
    captured = capfd.readouterr()
    manifest = (tmp_path / "fsx" / "v1" / M.MANIFEST_NAME).read_text()
    assert "staging s3://" in caplog.text + captured.out + captured.err  # the log line that named it
    assert leaked(caplog.text + captured.out + captured.err + json.dumps(out) + manifest) == []


# --- 7. multipart objects are verified by default ----------------------------------------------

@pytest.mark.parametrize("client", ["lean", "botocore", "s3fs", "memory-destination"])
def test_multipart_object_is_verified_by_default(s3, proxy, tmp_path, monkeypatch, client):
    """Without --verify strict a multipart object got size + fingerprint only, so a flipped byte
    landed. The default now recomputes the multipart ETag (part size from HEAD ?partNumber=1):
    the corrupt download is caught and refetched, and the manifest records the ETag."""
    import fsspec

    endpoint, faults = proxy
    body = os.urandom(11 * 1024 * 1024)
    etag = s3.put_multipart("p/mp.bin", body, part_size=5 * 1024 * 1024)
    if client in ("botocore", "s3fs"):
        monkeypatch.setenv("DTRAIN_S3_CLIENT", client)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    faults.corrupt["mp.bin"] = 1
    if client == "memory-destination":
        url, mem = f"memory://dtrain-mp-{uuid.uuid4().hex[:8]}", fsspec.filesystem("memory")
        stage(s3.url("p/"), url)
        root = url[len("memory://"):]
        staged, doc = mem.cat_file(f"/{root}/mp.bin"), json.loads(mem.cat_file(f"/{root}/{M.MANIFEST_NAME}"))
        mem.rm(f"/{root}", recursive=True)
    else:
        dest = tmp_path / "dest"
        stage(s3.url("p/"), str(dest), part_size="4MiB")
        staged, doc = (dest / "mp.bin").read_bytes(), json.loads((dest / M.MANIFEST_NAME).read_text())
    assert staged == body
    assert sum(1 for g in faults.gets if g.endswith("mp.bin")) >= 2  # fetched again after the mismatch
    assert doc["files"]["mp.bin"]["checksum"] == f"s3etag:{5 * 1024 * 1024}:{etag}"


def test_persistently_corrupt_multipart_object_fails_by_default(s3, proxy, tmp_path, monkeypatch):
    endpoint, faults = proxy
    s3.put_multipart("p/mp.bin", os.urandom(6 * 1024 * 1024))
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    faults.corrupt["mp.bin"] = 100
    dest = tmp_path / "dest"
    with pytest.raises(StagingError, match="mp.bin.*does not match"):
        stage(s3.url("p/"), str(dest), retries=1)
    assert not (dest / "mp.bin").exists() and not (dest / M.MANIFEST_NAME).exists()
