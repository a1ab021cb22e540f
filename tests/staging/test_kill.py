"""kill -9 in the middle of a real `dtrain stage`, then rerun: complete, no temp file, and no
partially written file ever visible at a final path."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

from dtrain.staging import manifest as M

from .conftest import wait_for

DTRAIN = os.path.join(os.path.dirname(sys.executable), "dtrain")


class FinalPathWatcher(threading.Thread):
    """Polls the destination; every file seen at a final path must already hold its full content."""

    def __init__(self, root: str, expected: dict[str, str]):
        super().__init__(daemon=True)
        self.root, self.expected = root, expected
        self.checked: set[tuple[str, int]] = set()
        self.violations: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.scan()
            time.sleep(0.005)
        self.scan()

    def scan(self) -> None:
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(".dtrain-"):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    ino = os.stat(path).st_ino
                    if (path, ino) in self.checked:
                        continue
                    with open(path, "rb") as f:
                        digest = hashlib.md5(f.read()).hexdigest()
                except FileNotFoundError:
                    continue
                rel = os.path.relpath(path, self.root)
                if digest != self.expected.get(rel):
                    self.violations.append(rel)
                self.checked.add((path, ino))


def temps(root: str) -> list[str]:
    return [n for _d, _s, files in os.walk(root) for n in files if n.startswith(M.TMP_PREFIX)]


def test_sigkill_mid_copy_then_rerun_completes(s3, proxy, tmp_path):
    endpoint, faults = proxy
    items = {f"ds/big/{i}.bin": os.urandom(3 * 1024 * 1024) for i in range(4)}
    items.update({f"ds/small/{i:02d}.bin": os.urandom(50_000) for i in range(40)})
    s3.put_many(items)
    expected = {k[3:]: hashlib.md5(v).hexdigest() for k, v in items.items()}
    dest = tmp_path / "dest"
    dest.mkdir()
    watcher = FinalPathWatcher(str(dest), expected)
    watcher.start()
    faults.bytes_per_second = 2_000_000  # per connection: the stage takes a few seconds
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    argv = [DTRAIN, "stage", s3.url("ds/"), str(dest), "--workers", "4", "--part-size", "1MiB", "--json"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        journal = dest / M.JOURNAL_NAME
        # Kill once some files have landed and others are half written.
        wait_for(lambda: journal.exists() and journal.read_bytes().count(b"\n") >= 2 and temps(str(dest)),
                 timeout=60, interval=0.01, what="a stage mid-copy")
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert temps(str(dest)), "the kill should have left a temporary file behind"
    assert not (dest / M.MANIFEST_NAME).exists()
    landed = journal.read_bytes().count(b"\n")
    faults.bytes_per_second = 0
    faults.gets.clear()
    rerun = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    watcher.stop.set()
    watcher.join(timeout=30)
    assert rerun.returncode == 0, rerun.stderr
    result = json.loads(rerun.stdout)
    assert result["skipped"] >= landed and result["fetched"] + result["skipped"] == len(items)
    assert result["fetched"] < len(items)  # resumed, not started over
    assert not temps(str(dest)) and not (dest / M.JOURNAL_NAME).exists()
    manifest = json.loads((dest / M.MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == set(expected)
    for rel, digest in expected.items():
        assert hashlib.md5((dest / rel).read_bytes()).hexdigest() == digest, rel
    assert watcher.violations == [], f"partial files seen at final paths: {watcher.violations}"
    assert len(watcher.checked) >= len(items)
