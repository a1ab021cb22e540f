"""An elastic job's rendezvous believes only what the job signed (dtrain.launch.node.rdzv_auth): on a real
store process (dtrain.launch.core.rdzv_store), a value planted by a client that reached its port is
refused before anything unpickles it, counted, named in the log, and replaced with the job's own; an
older state played back is refused too; the store listens only at the address it was given; the
secret reaches a process on its stdin, which then holds nothing for a child."""

from __future__ import annotations

import base64
import os
import pickle
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from dtrain.launch.core.rdzv_store import RendezvousStore
from dtrain.launch.node.elastic_rdzv import LOST_KEY, parse_lost, read_signed, signed_backend
from dtrain.launch.node.net import free_port
from dtrain.launch.node.rdzv_auth import StoreKey, Tampered, read_secret, secret_line
from tests.support import poll_until

SECRET = "5e" * 32
JOB = "job-a1"


class Payload:
    """What an attacker plants: unpickling it creates ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def store():
    """A real store process on loopback, its reports, and a client of it (as an agent or an attacker has)."""
    from torch.distributed import TCPStore

    reports: list[str] = []
    process = RendezvousStore(sink=reports.append)
    port = process.start("127.0.0.1", free_port("127.0.0.1"), SECRET)
    try:
        yield process, TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10)), reports
    finally:
        process.stop()


def test_a_value_moved_to_another_key_or_signed_with_another_secret_does_not_verify():
    key = StoreKey(SECRET)
    sealed = key.seal("a", b"value")
    assert key.open("a", sealed) == b"value"
    for name, value in (("b", sealed), ("a", StoreKey("0f" * 32).seal("a", b"value")), ("a", b"value"),
                        ("a", sealed[:-1] + b"X"), ("a", b":" + sealed)):
        with pytest.raises(Tampered):
            key.open(name, value)
    assert "5e5e" not in repr(key)


def test_the_store_listens_only_at_the_address_it_was_given(store):
    process, _, _ = store
    socket.create_connection(("127.0.0.1", process.port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):  # another address of this host (loopback's 127.0.0.2)
        socket.create_connection(("127.0.0.2", process.port), timeout=5)


def test_a_planted_state_is_never_unpickled_and_is_replaced_at_the_next_write(store, tmp_path, capfd):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    _, client, _ = store
    key = StoreKey(SECRET)
    backend = signed_backend(C10dRendezvousBackend(client, JOB), key)
    state = _RendezvousState()
    state.round = 3
    _, token, has_set = backend.set_state(pickle.dumps(state))
    assert has_set
    assert pickle.loads(backend.get_state()[0]).round == 3
    marker = tmp_path / "code-ran"
    client.set(f"torch.rendezvous.{JOB}", base64.b64encode(pickle.dumps(Payload(str(marker)))))
    believed, token = backend.get_state()
    assert pickle.loads(believed).round == 3 and not marker.exists()  # the last verified state, not the planted one
    assert backend.get_state()[0] == believed and key.refusals == 1  # one planted value: one refusal
    assert f"refused the value of 'torch.rendezvous.{JOB}'" in capfd.readouterr().err
    state.round = 4
    _, _, has_set = backend.set_state(pickle.dumps(state), token)  # written over the planted value
    assert has_set and key.open(f"torch.rendezvous.{JOB}", base64.b64decode(client.get(f"torch.rendezvous.{JOB}")))


def test_a_refused_state_is_replaced_in_the_store_at_once_and_torch_gets_its_token(store):
    """What torch's handler reads is what the store holds: its next compare-and-set lands."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    _, client, _ = store
    key = StoreKey(SECRET)
    backend = signed_backend(C10dRendezvousBackend(client, JOB), key)
    state = _RendezvousState()
    state.round = 2
    backend.set_state(pickle.dumps(state))
    client.set(f"torch.rendezvous.{JOB}", base64.b64encode(b"planted"))
    believed, token = backend.get_state()
    assert token == client.get(f"torch.rendezvous.{JOB}")  # the store's token: no longer the planted value's
    assert key.open(f"torch.rendezvous.{JOB}", base64.b64decode(token)).endswith(believed)
    state.round = 3
    assert backend.set_state(pickle.dumps(state), token)[2]  # torch's next write: no conflict, no re-read
    client.set(f"torch.rendezvous.{JOB}", C10dRendezvousBackend._NULL_SENTINEL)  # emptied: torch would start anew
    assert pickle.loads(backend.get_state()[0]).round == 3 and key.refusals == 2
    client.set(f"torch.rendezvous.{JOB}", b"abc")  # not even base64: torch would raise
    assert pickle.loads(backend.get_state()[0]).round == 3 and key.refusals == 3
    client.set(f"torch.rendezvous.{JOB}", b"\xff\xfe not text")  # not UTF-8: torch's own write would raise on it
    assert pickle.loads(backend.get_state()[0]).round == 3 and key.refusals == 4
    client.set(f"torch.rendezvous.{JOB}", b"\xff\xfd other")  # planted between a read and torch's write
    believed, token, written = backend.set_state(pickle.dumps(state), token)
    assert pickle.loads(believed).round == 3 and not written and key.refusals == 5


def test_the_time_a_planted_state_stays_is_not_counted_against_a_member_keep_alive(store):
    """A member's renewals written while another value sat in the store were lost with it: its
    keep-alive does not lapse for that; one that had lapsed (a declared loss) stays lapsed."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    _, client, _ = store
    key = StoreKey(SECRET)
    lapse = timedelta(seconds=4)
    backend = signed_backend(C10dRendezvousBackend(client, JOB), key, lapse.total_seconds())
    alive, lost = _NodeDesc("10.0.0.1", 1, 0), _NodeDesc("10.0.0.2", 2, 0)
    state = _RendezvousState()
    state.last_heartbeats = {alive: datetime.now(timezone.utc) - lapse + timedelta(seconds=2),
                             lost: datetime(1970, 1, 1, tzinfo=timezone.utc)}
    backend.set_state(pickle.dumps(state))
    client.set(f"torch.rendezvous.{JOB}", base64.b64encode(b"planted"))
    time.sleep(3)  # longer than the member had left: its renewals meanwhile went into the planted-over state
    beats = pickle.loads(backend.get_state()[0]).last_heartbeats
    assert beats[alive] > datetime.now(timezone.utc) - lapse, beats
    assert beats[lost] == datetime(1970, 1, 1, tzinfo=timezone.utc)


def test_an_older_state_played_back_is_refused(store):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    _, client, _ = store
    key = StoreKey(SECRET)
    backend = signed_backend(C10dRendezvousBackend(client, JOB), key)
    state = _RendezvousState()
    _, token, _ = backend.set_state(pickle.dumps(state))
    old = client.get(f"torch.rendezvous.{JOB}")  # genuine, signed by the job: an attacker recorded it
    state.round = 1
    _, token, _ = backend.set_state(pickle.dumps(state), token)
    client.set(f"torch.rendezvous.{JOB}", old)
    assert pickle.loads(backend.get_state()[0]).round == 1 and key.refusals == 1


def test_the_store_writes_the_lost_list_back_over_a_forged_one_and_names_it(store):
    process, client, reports = store
    key = StoreKey(SECRET)
    process.lost(2)
    assert poll_until(lambda: parse_lost(read_signed(client, key, LOST_KEY) or b"") == (1, ["2"]), 15, 0.1)
    client.set(LOST_KEY, b"0,1,2,3")
    assert read_signed(client, StoreKey(SECRET), LOST_KEY) in (None, key.seal(LOST_KEY, b"1:2")[65:])
    assert poll_until(lambda: client.get(LOST_KEY) == key.seal(LOST_KEY, b"1:2"), 15, 0.1)  # written back
    assert poll_until(lambda: any("refused the value of 'dtrain.lost'" in r for r in reports), 15, 0.1), reports


def test_the_secret_is_read_from_stdin_and_a_child_then_reads_nothing():
    code = ("import subprocess, sys; from dtrain.launch.node.rdzv_auth import read_secret; "
            "print(read_secret(0) == sys.argv[1]); "
            "print(repr(subprocess.run(['cat'], capture_output=True).stdout))")
    done = subprocess.run([sys.executable, "-c", code, SECRET], input=secret_line(SECRET) + b"more\n",
                          capture_output=True, timeout=60)
    assert done.stdout.decode().split() == ["True", "b''"], done.stderr
    bad = subprocess.run([sys.executable, "-c", code, SECRET], input=b'{"secret": "nothex"}\n', capture_output=True,
                         timeout=60)
    assert bad.returncode != 0 and b"64 lowercase hex" in bad.stderr
