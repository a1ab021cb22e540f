"""The elastic rendezvous ``dtrain-c10d`` and the agent that runs it (a job with ``nodes="MIN:MAX"``).

torchrun's c10d rendezvous, with two things torch 2.13 does not do:

* **A member that vanishes re-forms the round.** torch re-forms a round when a node *waits* to join
  (``num_nodes_waiting``), or when the survivors' workers fail. A node that is cut off or frozen
  fails nobody: its peers hang in their next collective (pytorch/pytorch#111646). Here, once the
  rendezvous has dropped a member of the current round (its keep-alive lapsed: ``keep_alive_interval``
  x ``keep_alive_max_attempt`` seconds, and some agent's sync swept it), ``num_nodes_waiting`` says
  so, and each survivor's agent restarts its workers into the next round, as for a node that joins
  (not counted against ``--max-restarts``).
* **The launcher's word is taken at once.** The launcher knows a node is lost long before the
  keep-alive lapses (its ssh session ended, its Slurm lease went stale): it lists the node's index
  under :data:`LOST_KEY` in the store (:mod:`dtrain.launch.core.rdzv_store`). Each agent publishes
  which rendezvous member it is under :func:`node_key` (its ``DTRAIN_NODE_INDEX``), so the survivors
  mark that member's keep-alive as lapsed and the round re-forms without the wait. A node the
  launcher starts again is taken off the list first.
* **A membership change is not the script's failure.** A crashed node makes its peers' workers fail
  at once (a reset connection); so does a peer whose agent restarted its workers first when a node
  joins (each agent sees the joining node at its own monitor interval). torchrun would count that
  against ``--max-restarts`` and, at 0, end the job. :class:`ElasticAgent` waits, after a failure, up
  to :func:`sweep_window` for the rendezvous to drop a member of the round or to show a node waiting
  to join; if it does, the restart is the membership's, not counted. Unless a member's workers
  succeeded in that round (it says so under :func:`done_key` before torch's exit barrier): then the
  round is over, and a worker that fails at its end (a rank that crashes while saving) fails the job,
  as in a fixed one; it is not re-run alone from the last checkpoint while its peer waits.

After every round the handler prints one line (:data:`ROUND_TAG`): this node's index (the backend's
``DTRAIN_NODE_INDEX``), the round, its group rank and the group's size. The launcher gathers them
into the job's rounds (:mod:`dtrain.launch.engine.rounds`): for the log, XCom and the Training tab.

**Only the job's own values are believed.** The store accepts anyone who reaches its port, so
every value this rendezvous writes there is signed with the job's secret, and every value it reads
is verified before anything else looks at it (:mod:`dtrain.launch.node.rdzv_auth`): torch's state
(which it would unpickle) through :func:`signed_backend`, :data:`LOST_KEY` and the :func:`node_key`
values in :meth:`ElasticRendezvous._take_losses`, and the address and port of each round's worker
store, which node 0's agent opens before the round's workers start (torch would have every agent read
them back as plain values: :mod:`dtrain.launch.node.worker_store`). A value that fails is refused, counted and named
in the log; the job goes on: the agent that reads a tampered state writes its last verified one back
over it at once (compare-and-set against the refused value, re-signed), and torch's handler sees only
that, with its token; the time the store held the planted value is not counted against any member's
keep-alive (their renewals were lost with it). An older state played back is refused as one (each
state carries a version that only grows). A declared loss names the launcher's sequence number, and
a member takes only the losses declared after it joined: a loss played back from earlier cannot
remove a node that came back. The secret reaches the agent on its stdin (:func:`use_secret`, called
by :mod:`dtrain.launch.node.torchrun_agent`), never its workers.

Rounds after the first complete :data:`REFORM_LAST_CALL_S` after MIN nodes are back (the first waits
the rendered ``last_call_timeout`` for slow starters): every node that can take part is already
running and reacts within a monitor interval.

The store lives outside the training nodes (:mod:`dtrain.launch.core.rdzv_store`, started by the
launcher): ``is_host=0`` on every node, so the loss of any node leaves it.

Stdlib at import; torch is imported only by the functions, on the node.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from functools import lru_cache
from typing import Any

from dtrain.launch.node.rdzv_auth import StoreKey
from dtrain.launch.node.worker_store import round_bootstrap, round_store_key

ELASTIC = "dtrain-c10d"
ROUND_TAG = "[dtrain-round]"
#: the agent's exit when the job ended before this node ran a round of its own (it waited for the
#: next round, or was a spare, when the rendezvous closed): neither the job's success nor its failure
NO_ROUND_EXIT_CODE = 75
#: how often an agent renews its membership (seconds), and how many renewals it may miss before the
#: rendezvous drops it: a node silent for KEEP_ALIVE_S x KEEP_ALIVE_ATTEMPTS is gone from the round
KEEP_ALIVE_S = 3
KEEP_ALIVE_ATTEMPTS = 3
#: seconds a round after the first waits for more nodes once MIN are in (two of SYNC_S)
REFORM_LAST_CALL_S = 0.5
#: seconds between two reads of the rendezvous state while an agent waits in a rendezvous (torch: 1 s,
#: and a 1 s cache): a round re-forms within a few of them. Four reads a second per waiting agent;
#: while its workers run, an agent reads the state at most every MONITOR_CACHE_S (torch's), as before.
SYNC_S = 0.25
MONITOR_CACHE_S = 1.0
#: the store key listing the node indexes the launcher has declared lost, after the number of its last
#: change ("3:0,2", signed: :func:`lost_value`); the store process sets it
LOST_KEY = "dtrain.lost"
#: seconds between two looks at LOST_KEY by an agent
LOST_CHECK_S = 1.0
#: how many times an agent writes its last verified state over a refused one in a row before it
#: leaves the store as it is until its next read
RESTORE_TRIES = 5


#: the job's key, once the agent has read its secret (:func:`use_secret`)
_job_key: StoreKey | None = None


def use_secret(secret: str) -> StoreKey:
    """Sign and verify this agent's rendezvous values with the job's ``secret`` (read from its stdin)."""
    global _job_key
    _job_key = StoreKey(secret)
    return _job_key


def job_key() -> StoreKey:
    if _job_key is None:
        raise RuntimeError(f"the {ELASTIC} rendezvous needs the job's secret (read by the agent from its stdin)")
    return _job_key


def lost_value(sequence: int, lost: "set[int] | list[int]") -> bytes:
    """:data:`LOST_KEY`'s value before it is signed: the number of the change, then the lost nodes."""
    return f"{int(sequence)}:{','.join(map(str, sorted(lost)))}".encode()


def parse_lost(value: bytes) -> tuple[int, list[str]]:
    """(sequence number, lost node indexes) of a verified :data:`LOST_KEY` value."""
    sequence, _, nodes = value.decode(errors="replace").partition(":")
    return (int(sequence) if sequence.isdigit() else 0), [i for i in nodes.split(",") if i.isdigit()]


def read_signed(store: Any, key: StoreKey, name: str) -> bytes | None:
    """Key ``name``'s value if it is there and verifies; else None (a refused value is counted and logged)."""
    if not store.check([name]):
        return None
    return key.open_or_refuse(name, store.get(name))


def wait_signed(store: Any, key: StoreKey, name: str, timeout: timedelta) -> bytes:
    """Key ``name``'s value once one that verifies is there; a refused one is named in the log (once)
    and waited past. TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    missing = f"no value of {name!r} signed by this job's rendezvous in {timeout.total_seconds():.0f} s"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(missing)
        try:
            store.wait([name], timedelta(seconds=remaining))
        except RuntimeError as e:  # torch's DistStoreError on a timeout
            raise TimeoutError(missing) from e
        value = read_signed(store, key, name)
        if value is not None:
            return value
        time.sleep(SYNC_S)  # a planted value: node 0's own may still come


def node_key(index: str | int) -> str:
    """The store key under which node ``index``'s agent publishes the rendezvous member it is."""
    return f"dtrain.node.{index}"


def done_key(round_: int) -> str:
    """The store key under which an agent whose workers succeeded in round ``round_`` says so."""
    return f"dtrain.done.{int(round_)}"


def member_text(node: Any) -> str:
    """A rendezvous member (torch's _NodeDesc) as published under :func:`node_key`."""
    return f"{node.addr}_{node.pid}_{node.local_id}"


def sweep_window(keep_alive_s: float = KEEP_ALIVE_S, attempts: int = KEEP_ALIVE_ATTEMPTS) -> float:
    """Seconds within which the rendezvous drops a member that stopped renewing: its last renewal may
    be one interval old when it stops, and a sync must run to sweep it."""
    return keep_alive_s * (attempts + 1) + 1.0


def round_line(node: str, round_: int, group_rank: int, group_world_size: int, key: StoreKey) -> str:
    """The line an agent prints after a round, signed with the job's key: the launcher counts no other."""
    body = f"{ROUND_TAG} node={node} round={round_} group_rank={group_rank} group_world_size={group_world_size}"
    return f"{body} mac={key.round_mac(body)}"


def signed_backend(inner: Any, key: StoreKey, lapse_s: float = KEEP_ALIVE_S * KEEP_ALIVE_ATTEMPTS):
    """torch's C10d rendezvous backend ``inner``, with the state signed on write and verified on read,
    before torch unpickles it (see the module's docstring). ``lapse_s``: the rendezvous's keep-alive
    lapse (interval x attempts)."""
    import binascii
    import pickle
    from base64 import b64decode, b64encode
    from datetime import datetime, timedelta, timezone

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, _RendezvousState

    lapse = timedelta(seconds=lapse_s)

    class SignedBackend(RendezvousBackend):
        """What torch's handler reads is always what the store holds: a refused value is replaced in the
        store by the agent's last verified state (compare-and-set against the refused bytes) before
        the read returns, with the store's token of the replacement. Handing torch an old state under
        the refused value's token would let its next write land on a state no other agent has read,
        and the state it rebuilds would differ from every other agent's."""

        def __init__(self):
            self.state_key = inner._key  # torch.rendezvous.<run id>
            self.version = 0  # of the newest state verified here: an older one is a replay
            self.last_good: bytes | None = None
            self.seen_at: datetime | None = None  # when the store last held a state verified here

        @property
        def name(self) -> str:
            return inner.name

        def _verified(self, sealed: bytes) -> bytes | None:
            """The state in ``sealed`` if it is the job's and not older than one this wrapper verified, else
            None (refused)."""
            value = key.open_or_refuse(self.state_key, sealed)
            version, sep, state = (value or b"").partition(b":")
            if value is None:
                return None
            if not (sep and version.isdigit() and int(version) >= self.version):
                key.refuse_once(self.state_key, sealed, "an older state played back")
                return None
            self.version, self.last_good, self.seen_at = int(version), state, datetime.now(timezone.utc)
            return state

        def _restored(self) -> bytes:
            """The last verified state, to write over a refused one. The time the store held a value that
            is not the job's is not counted against any member's keep-alive: the renewals written meanwhile
            were lost with the state they were in. A keep-alive that had already lapsed stays lapsed (a
            member the launcher declared lost is still dropped)."""
            if self.last_good is None:
                return pickle.dumps(_RendezvousState())
            state = pickle.loads(self.last_good)  # verified here: the job's own
            now = datetime.now(timezone.utc)
            for node, beat in state.last_heartbeats.items():
                if beat >= self.seen_at - lapse:
                    state.last_heartbeats[node] = beat + (now - self.seen_at)
            return pickle.dumps(state)

        def _seal(self, state: bytes) -> bytes:
            return key.seal(self.state_key, b"%d:" % (self.version + 1) + state)

        def _believed(self, got: "tuple[bytes, Any] | None") -> "tuple[bytes, Any] | None":
            """(state, token) of what the store holds, once a refused value there is replaced."""
            for _ in range(RESTORE_TRIES):
                if got is not None:
                    state = self._verified(got[0])
                    if state is not None:
                        return state, got[1]
                elif self.last_good is None:
                    return None  # no state yet: a new rendezvous
                else:  # torch never empties a state it wrote
                    key.refuse_once(self.state_key, b"", "the state was removed")
                restored = self._compare_set(self._seal(self._restored()), None if got is None else got[1])
                got = None if restored is None else restored[:2]
            # still replaced by someone else after every try: torch's next write compares against that
            return (self.last_good or pickle.dumps(_RendezvousState())), (None if got is None else got[1])

        def _decoded(self, raw: bytes) -> "tuple[bytes, Any] | None":
            """(state, token) of the store's ``raw`` value as torch decodes it; a value that is not even
            base64 (torch would raise) comes back as itself, to be refused and compared against."""
            if raw == inner._NULL_SENTINEL.encode():
                return None
            try:
                return b64decode(raw, validate=True), raw
            except binascii.Error:
                return raw, raw

        def _compare_set(self, sealed: bytes, token: Any) -> "tuple[bytes, Any, bool] | None":
            """torch's ``set_state``, with the expected value passed as the bytes it is: a planted value
            need not be UTF-8 text, which torch's own decodes (and would raise on)."""
            expected = token if isinstance(token, bytes) and token else inner._NULL_SENTINEL.encode()
            raw = inner._call_store("compare_set", self.state_key, expected, b64encode(sealed).decode())
            got = self._decoded(raw)
            return None if got is None else (*got, got[0] == sealed)

        def get_state(self):
            return self._believed(self._decoded(inner._call_store("get", self.state_key)))

        def set_state(self, state: bytes, token: Any = None):
            got = self._compare_set(self._seal(state), token)
            believed = self._believed(None if got is None else got[:2])
            return None if believed is None else (*believed, bool(got and got[2]))

    return SignedBackend()


@lru_cache(maxsize=None)
def _classes():
    """(ElasticRendezvous, ElasticAgent), built on first use (torch imported here, on the node)."""
    from datetime import datetime, timedelta, timezone

    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous import RendezvousClosedError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class ElasticRendezvous(DynamicRendezvousHandler):
        members: frozenset = frozenset()
        round_: int = -1
        worker_store = None  # node 0's store of this round, on node 0
        _losses_checked = 0.0

        def next_rendezvous(self):
            self._state_holder._cache_duration = SYNC_S  # quick reads only while waiting here
            try:
                info = super().next_rendezvous()
            finally:
                self._state_holder._cache_duration = MONITOR_CACHE_S
            state = self._state_holder.state
            self.members, self.round_ = frozenset(state.participants), state.round
            # later rounds re-form among running nodes: no wait for slow starters (shared with the op executor)
            self._settings.timeout._last_call = timedelta(seconds=REFORM_LAST_CALL_S)
            print(round_line(os.environ.get("DTRAIN_NODE_INDEX", "?"), state.round, info.rank, info.world_size,
                             job_key()), flush=True)
            return self._with_worker_store(info, state.round)

        @property
        def use_agent_store(self) -> bool:
            return True  # the round's worker store is node 0's agent's (_with_worker_store)

        def _with_worker_store(self, info, round_: int):
            """``info`` bootstrapping the workers from a store node 0's agent opens for this round, its
            address and port signed with the job's key (:mod:`dtrain.launch.node.worker_store`): torch
            would hand the workers the plain values any client of the store can overwrite."""
            key, name, timeout = job_key(), round_store_key(round_), self._settings.timeout.join
            self.worker_store = None  # the previous round's store closes
            info, self.worker_store = round_bootstrap(
                info, addr=self._this_node.addr, timeout=timeout,
                publish=lambda value: info.store.set(name, key.seal(name, value.encode())),
                fetch=lambda: wait_signed(info.store, key, name, timeout).decode(errors="replace"))
            return info

        def num_nodes_waiting(self) -> int:
            waiting = super().num_nodes_waiting()  # syncs: a member whose keep-alive lapsed is swept
            return waiting or int(self._member_gone())

        def _member_gone(self) -> bool:
            """The launcher declared a member of this node's round lost, or the rendezvous dropped one."""
            return self._take_losses() or self._swept()

        def _swept(self) -> bool:
            """A member of this node's round is nowhere in the rendezvous (participants, wait or
            redundancy list): the rendezvous dropped it. A member that restarts on its own leaves and
            rejoins within one operation, so it is seen in one of them."""
            with self._heartbeat_lock:
                self._state_holder.sync()
                present = set(self._state_holder.state.last_heartbeats)
            return bool(self.members - present)

        def _take_losses(self) -> bool:
            """Mark the keep-alive of every member the launcher declared lost as lapsed (at most once
            every LOST_CHECK_S): the next sync of any agent drops it from the rendezvous. True when a
            member of this node's round is among them."""
            if time.monotonic() - self._losses_checked < LOST_CHECK_S:
                return False
            self._losses_checked = time.monotonic()
            value = read_signed(self._store, job_key(), LOST_KEY)
            if value is None:
                return False
            sequence, lost = parse_lost(value)
            doomed = set()
            for index in lost:  # a member that joined after the loss was declared is not the lost one
                published = read_signed(self._store, job_key(), node_key(index))
                member, _, joined = (published or b"").decode(errors="replace").rpartition("@")
                if member and joined.isdigit() and int(joined) < sequence:
                    doomed.add(member)
            if not doomed:
                return False
            with self._heartbeat_lock:
                for _ in range(5):  # the state is compare-and-set: another agent may write it meanwhile
                    self._state_holder.sync()
                    beats = self._state_holder.state.last_heartbeats
                    hit = [member for member in beats if member_text(member) in doomed]
                    if not hit:
                        break
                    for member in hit:
                        beats[member] = datetime(1970, 1, 1, tzinfo=timezone.utc)
                    self._state_holder.mark_dirty()
                    if self._state_holder.sync():
                        break
            return any(member_text(member) in doomed for member in self.members)

        def finished(self) -> None:
            """Say that this node's workers succeeded in this round (before torch's exit barrier, where
            the agent then waits for its peers): a peer whose workers fail now is not left behind."""
            name = done_key(self.round_)
            self._store.set(name, job_key().seal(name, member_text(self._this_node).encode()))
            # TCPStore's set is not answered: without a round trip on the same connection, a peer that
            # reads next could still find no value. The server answers one connection in order.
            self._store.check([name])

        def round_finished(self) -> bool:
            """Whether some member's workers succeeded in this node's round (a value the job signed)."""
            return read_signed(self._store, job_key(), done_key(self.round_)) is not None

        def membership_change(self, within: float) -> str | None:
            """Why this round's membership changes, looked for during ``within`` seconds: ``"is gone"``
            when the launcher declares a member lost or the rendezvous drops one (seen twice, half a
            second apart, so a member between leaving and rejoining is not taken), ``"joins"`` when a
            node waits for the next round; None when neither happens."""
            deadline = time.monotonic() + within
            while True:
                if self.round_finished():
                    return None  # a member's workers succeeded: the round is over, a failure is the script's
                if self._take_losses():
                    return "is gone"
                if self._swept():
                    time.sleep(0.5)
                    if self._swept():
                        return "is gone"
                if DynamicRendezvousHandler.num_nodes_waiting(self) > 0:
                    # A node joins: the agents restart their workers into the next round, each when its
                    # monitor sees it, so a peer that restarted first fails this node's collective.
                    return "joins"
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.5)

    class ElasticAgent(LocalElasticAgent):
        def _exit_barrier(self):
            handler = self._worker_group.spec.rdzv_handler
            if isinstance(handler, ElasticRendezvous):
                handler.finished()
            super()._exit_barrier()

        def run(self, *args, **kwargs):
            result = super().run(*args, **kwargs)
            if result is None:  # torch's "graceful exit": a spare when the rendezvous closed
                raise RendezvousClosedError("the rendezvous closed while this node was a spare")
            return result

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            handler = worker_group.spec.rdzv_handler
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and isinstance(handler, ElasticRendezvous):
                window = sweep_window(handler._settings.keep_alive_interval.total_seconds(),
                                      handler._settings.keep_alive_max_attempt)
                change = handler.membership_change(window)
                if change is not None:
                    self._remaining_restarts += 1  # the restart that follows re-forms the round: not counted
                    print(f"[dtrain] a node of round {handler.round_} {change}: the workers restart into the "
                          f"next round (not counted against max_restarts)", file=sys.stderr, flush=True)
            return result

    return ElasticRendezvous, ElasticAgent


def elastic_handler(params: Any):
    """The ``dtrain-c10d`` handler for torchrun's registry (its ``create_handler``, on our class)."""
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    def seconds(key: str) -> timedelta | None:
        value = params.get_as_int(key + "_timeout")
        return None if value is None else timedelta(seconds=value)

    key = job_key()
    keep_alive_s = params.get_as_int("keep_alive_interval", KEEP_ALIVE_S)
    attempts = params.get_as_int("keep_alive_max_attempt", KEEP_ALIVE_ATTEMPTS)
    backend, store = create_backend(params)
    backend = signed_backend(backend, key, keep_alive_s * attempts)
    handler_cls, _ = _classes()
    timeout = RendezvousTimeout(seconds("join"), seconds("last_call"), seconds("close"), seconds("heartbeat"))
    handler = handler_cls.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr, timeout,
        keep_alive_interval=keep_alive_s, keep_alive_max_attempt=attempts)
    handler._backend_name = ELASTIC  # what get_backend() reports: the registry checks it
    _quicker_syncs()
    lost = read_signed(store, key, LOST_KEY)
    joined = parse_lost(lost)[0] if lost is not None else 0  # the losses declared so far are not this member's
    name = node_key(os.environ.get("DTRAIN_NODE_INDEX", "?"))
    store.set(name, key.seal(name, f"{member_text(handler._this_node)}@{joined}".encode()))
    return handler


def _quicker_syncs() -> None:
    """Wait SYNC_S seconds, not torch's 1 s, between two reads of the rendezvous state in a rendezvous
    (this agent process's only one; its cache is shortened meanwhile by ``next_rendezvous``): a round
    re-forms in about a second."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    delay = dynamic_rendezvous._delay
    if getattr(delay, "dtrain", False):
        return

    def quicker(seconds):  # the SYNC wait is a number; the first round's random skew a range: kept
        delay(min(seconds, SYNC_S) if isinstance(seconds, (int, float)) else seconds)

    quicker.dtrain = True
    dynamic_rendezvous._delay = quicker


def elastic_agent_class():
    return _classes()[1]
