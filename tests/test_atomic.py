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
from tests.support import record_fsyncs


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
    synced = record_fsyncs(monkeypatch)
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


# -- the rule: every file write that renames into place goes through dtrain.atomic ----------------

#: "module:function" -> why its rename is not a file write dtrain.atomic should make
RENAMES_ALLOWED = {
    "atomic.py:atomic_open": "the one atomic file write itself",
    "pipeline/publish.py:publish_model": "renames a whole model directory into place (and the old one aside)",
    "mlflow/registry.py:MlflowRegistry._download": "renames a downloaded directory into place",
    "launch/node/ranklog.py:RankLog._rotate": "log rotation: the live log becomes rank<N>.log.1",
    "staging/posixdest.py:PosixTempFile.land": "a staged file written in ranges by several workers, fsynced "
                                               "by the batch (syncfs), landed later: no single with-block",
}
RENAMES = {"os.rename", "os.replace", "os.renames", "shutil.move"}


def renames_in(package: str) -> dict[str, list[int]]:
    """"module:qualified function" -> lines of a rename call, for every module under ``package``."""
    import ast

    found: dict[str, list[int]] = {}

    def visit(node: ast.AST, rel: str, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, rel, [*scope, child.name])
                continue
            if isinstance(child, ast.Call) and ast.unparse(child.func) in RENAMES:
                found.setdefault(f"{rel}:{'.'.join(scope) or '<module>'}", []).append(child.lineno)
            visit(child, rel, scope)

    for directory, _, files in os.walk(package):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as fh:
                    visit(ast.parse(fh.read(), path), os.path.relpath(path, package).replace(os.sep, "/"), [])
    return found


def test_no_module_renames_a_file_into_place_except_through_dtrain_atomic():
    found = renames_in(os.path.dirname(atomic.__file__))
    unexplained = {where: lines for where, lines in found.items() if where not in RENAMES_ALLOWED}
    assert not unexplained, ("a file written by rename outside dtrain.atomic (use dtrain.atomic.atomic_open or "
                             "atomic_write_bytes, or add a directory rename to RENAMES_ALLOWED with why): "
                             f"{unexplained}")
    assert not set(RENAMES_ALLOWED) - set(found), "RENAMES_ALLOWED names renames that are gone"


def test_the_rename_scan_sees_a_planted_writer(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "writer.py").write_text(
        "import os\nclass W:\n    def save(self, tmp, path):\n        os.replace(tmp, path)\n"
        "def text(s):\n    return s.replace('a', 'b')\n")
    assert renames_in(str(tmp_path)) == {"sub/writer.py:W.save": [4]}
