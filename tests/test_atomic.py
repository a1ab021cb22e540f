"""dtrain.atomic: the one atomic file write (exclusive no-follow temp file, fsync, rename, fsync the
directory), on real files: a failure mid-write keeps the old file and leaves no temporary file, a
link planted at the temporary name or at the target is never written through."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from dtrain import atomic
from dtrain.atomic import atomic_open, atomic_write_bytes, fsync_directory


class Boom(Exception):
    pass


def test_the_new_content_replaces_the_file_and_no_temporary_file_is_left(tmp_path):
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    atomic_write_bytes(str(target), b"new")
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["state.json"]


def test_an_exception_mid_write_keeps_the_old_file_and_removes_the_temporary_one(tmp_path):
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    with pytest.raises(Boom):
        with atomic_open(str(target)) as fh:
            fh.write(b"half of the new")
            fh.flush()
            assert len(os.listdir(tmp_path)) == 2  # the temporary file exists while writing
            raise Boom()
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failed_rename_removes_the_temporary_file(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "inside").write_bytes(b"")  # a non-empty directory: rename over it fails
    with pytest.raises(OSError):
        atomic_write_bytes(str(tmp_path / "taken"), b"new")
    assert sorted(os.listdir(tmp_path)) == ["taken"]


def test_a_symlink_at_the_target_is_replaced_not_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "result.json"
    target.symlink_to(victim)
    atomic_write_bytes(str(target), b"new")
    assert victim.read_bytes() == b"precious"
    assert not target.is_symlink() and target.read_bytes() == b"new"


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlink_planted_at_the_temporary_name_is_refused_not_followed(tmp_path, dangling):
    victim = tmp_path / "victim"
    if not dangling:
        victim.write_bytes(b"precious")
    planted = tmp_path / ".result.json.planted.tmp"
    planted.symlink_to(victim)
    target = tmp_path / "result.json"
    target.write_bytes(b"old")
    with pytest.raises(OSError) as raised:
        atomic_write_bytes(str(target), b"new", temp=planted.name)
    assert raised.value.errno in (errno.EEXIST, errno.ELOOP)
    assert target.read_bytes() == b"old"
    assert planted.is_symlink()  # someone else's link: refused, left alone
    assert victim.read_bytes() == b"precious" if not dangling else not victim.exists()


def test_the_default_temporary_name_is_hidden_and_unpredictable(tmp_path):
    first, second = atomic.temp_name("x.pt"), atomic.temp_name("x.pt")
    assert first != second
    assert first.startswith(f".x.pt.{os.getpid()}.") and first.endswith(".tmp")


def test_relative_to_a_directory_descriptor(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "victim").write_bytes(b"precious")
    (folder / "exit.json").symlink_to(folder / "victim")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        atomic_write_bytes("exit.json", b"{}", dir_fd=fd, mode=0o600)
        with pytest.raises(Boom):
            with atomic_open("exit.json", dir_fd=fd) as fh:
                fh.write(b"partial")
                raise Boom()
        with pytest.raises(ValueError):
            atomic_write_bytes(str(folder / "exit.json"), b"", dir_fd=fd)
    finally:
        os.close(fd)
    assert (folder / "exit.json").read_bytes() == b"{}" and not (folder / "exit.json").is_symlink()
    assert (folder / "victim").read_bytes() == b"precious"
    assert stat.S_IMODE(os.stat(folder / "exit.json").st_mode) == 0o600 & ~_umask()
    assert sorted(os.listdir(folder)) == ["exit.json", "victim"]


def test_mode_is_the_new_files_permissions_under_the_umask(tmp_path):
    atomic_write_bytes(str(tmp_path / "a"), b"", mode=0o666)
    atomic_write_bytes(str(tmp_path / "b"), b"")
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o666 & ~_umask()
    assert stat.S_IMODE(os.stat(tmp_path / "b").st_mode) == 0o644 & ~_umask()


def test_the_file_and_the_directory_are_fsynced_unless_told_not_to(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    atomic_write_bytes(str(tmp_path / "a"), b"x")
    assert synced == ["file", "dir"]
    synced.clear()
    atomic_write_bytes(str(tmp_path / "a"), b"x", fsync_dir=False)
    assert synced == ["file"]
    synced.clear()
    atomic_write_bytes(str(tmp_path / "a"), b"x", fsync=False, fsync_dir=False)
    assert synced == []


@pytest.mark.parametrize("code, raised", [(errno.EINVAL, False), (errno.EIO, True)])
def test_a_directory_fsync_refused_by_the_filesystem_is_let_be_a_real_error_is_not(tmp_path, monkeypatch,
                                                                                   code, raised):
    def failing_fsync(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    if raised:
        with pytest.raises(OSError):
            fsync_directory(str(tmp_path))
    else:
        fsync_directory(str(tmp_path))
    fsync_directory(str(tmp_path / "missing"))  # nothing to open: nothing to make durable


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def test_an_opener_gets_the_exclusive_no_follow_flags_and_may_refuse(tmp_path):
    seen: list[int] = []

    def refusing_opener(path, flags):
        seen.append(flags)
        raise PermissionError(f"refusing {path}")

    (tmp_path / "a").write_bytes(b"old")
    with pytest.raises(PermissionError):
        atomic_write_bytes(str(tmp_path / "a"), b"new", opener=refusing_opener)
    assert seen[0] & os.O_EXCL and seen[0] & os.O_NOFOLLOW and seen[0] & os.O_CREAT
    assert (tmp_path / "a").read_bytes() == b"old" and os.listdir(tmp_path) == ["a"]
    atomic_write_bytes(str(tmp_path / "a"), b"new", opener=lambda path, flags: os.open(path, flags, 0o600))
    assert (tmp_path / "a").read_bytes() == b"new"
