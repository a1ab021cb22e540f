"""An elastic job (``nodes="MIN:MAX"``) as the launcher follows it: which nodes still run, and its rounds.

What is decided here comes from the launcher's own processes (one per node: a local agent, an ssh
client) or the nodes' leases (Slurm), never from what a node prints: a node is *lost* when its process
ends the way the backend says a lost node ends (ssh: 255; local: a signal the backend did not send) or
its lease says so, *done* when it exits 0, *idle* when its agent says the job ended before it ran a
round (``NO_ROUND_EXIT_CODE``: it waited for the next round or was a spare), *failed* otherwise. :class:`Membership`
turns that into the job's status at each poll:

* a lost node with at least MIN nodes still running: the job goes on (the survivors' agents re-form
  the round without it: :mod:`dtrain.launch.node.elastic_rdzv`); the backend may bring the host back
  (:meth:`Membership.returned`), and spares already wait in the rendezvous;
* fewer than MIN still running after a loss: the lost-node verdict (the job ends, the retry policy
  decides, as for a fixed job);
* a node that failed (not lost): the job failed, whether or not a peer succeeded first (a script
  that fails fails on every node of the round; a rank 0 that crashes while saving after its peers
  finished fails the job too);
* every node ended and one succeeded: done (nodes that were waiting for a next round when the
  round's members finished end then too, idle);
* a node that failed while the others ended idle: the job failed, whatever order the launcher saw
  the ends in (the failed node closed the rendezvous; the idle ones are no success).

:class:`Rounds` gathers the line each node's agent prints after each round (``[dtrain-round]``,
tagged by the launcher with the node its stream belongs to) into the job's rounds: which nodes, the
world size and the step the round resumed from (the latest checkpoint then). The lines are a node's
output, so they are parsed with a strict grammar and used only to report, never to decide; and each
must end with the agent's MAC, keyed with the job's secret (which the agents hold and their ranks'
environment does not: :mod:`dtrain.launch.node.rdzv_auth`), so that a rank printing round lines
into a log the launcher reads (Slurm's one output file) adds no round.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dtrain.launch.backends.base import JobStatus
from dtrain.launch.core.lost import LostNode
from dtrain.launch.node.elastic_rdzv import NO_ROUND_EXIT_CODE, ROUND_TAG
from dtrain.launch.node.rdzv_auth import StoreKey
from dtrain.rundir import RunDir, UnsafeRunDir

if TYPE_CHECKING:
    from dtrain.launch.core.processes import NodeProcess

#: a round line as the supervisor passes it on: ``[node<stream>] [dtrain-round] node=N round=R ...``; a
#: backend whose nodes' output is one stream (Slurm's output file) passes it on untagged
ROUND_LINE = re.compile(r"(?:\[node(\d{1,5})\] )?(" + re.escape(ROUND_TAG)
                        + r" node=(\d{1,5}) round=(\d{1,9}) group_rank=(\d{1,5}) group_world_size=(\d{1,5}))"
                        + r" mac=([0-9a-f]{64})")
MAX_ROUNDS = 1000  # kept in the result (XCom); a job that re-forms more often keeps its last ones
#: rounds told by some of their members only, kept at once: a forged line cannot grow the launcher's memory
MAX_OPEN_ROUNDS = 16


@dataclass
class Round:
    round: int
    nodes: int  # the round's size (nodes in it)
    members: dict[int, int] = field(default_factory=dict)  # node index -> group rank
    world_size: int = 0
    resume_step: int = 0

    def to_dict(self) -> dict[str, Any]:
        order = sorted(self.members, key=self.members.__getitem__)
        return {"round": self.round, "nodes": order, "world_size": self.world_size, "resume_step": self.resume_step}


class Rounds:
    """The rounds of one job, from its nodes' round lines (:meth:`feed`); thread-safe. ``tagged``: each
    line comes tagged with the node whose stream it came from (ssh, local), which must be the node it
    names; untagged (Slurm's one output file), the line's own node is taken. ``key``: the job's, which
    every counted line's MAC must verify with."""

    def __init__(self, run_dir: str, procs_per_node: int, hosts: Sequence[str], sink: Callable[[str], None],
                 key: StoreKey, tagged: bool = True, on_round: Callable[[Round], None] | None = None):
        self.run_dir, self.procs_per_node, self.hosts, self.sink = run_dir, procs_per_node, list(hosts), sink
        self.key = key
        self.tagged, self.on_round = tagged, on_round
        self._open: dict[int, Round] = {}
        self.done: list[Round] = []
        self._lock = threading.Lock()

    def feed(self, line: str) -> bool:
        """Take ``line`` if it is a round line of the node whose stream it came from (True: it is
        consumed, not shown); a round is reported once every member has told it."""
        match = ROUND_LINE.fullmatch(line)
        if match is None or (match.group(1) is None) == self.tagged:
            return False
        node, number, rank, size = map(int, match.groups()[2:6])
        stream = int(match.group(1)) if self.tagged else node
        if stream != node or node >= len(self.hosts) or rank >= size or size > len(self.hosts):
            return False  # not this node's own line: shown as output, never counted
        if not self.key.round_ok(match.group(2), match.group(7)):
            return False  # not an agent's (a rank's forgery): shown as output, never counted
        with self._lock:
            if any(r.round == number for r in self.done):
                return True
            if number not in self._open and len(self._open) >= MAX_OPEN_ROUNDS:
                del self._open[min(self._open)]  # the oldest untold round: its members moved on
            current = self._open.setdefault(number, Round(round=number, nodes=size))
            if current.nodes != size:
                return True
            current.members[node] = rank
            if len(current.members) == size and len(set(current.members.values())) == size:
                self._complete(self._open.pop(number))
        return True

    def _complete(self, round_: Round) -> None:
        round_.world_size = round_.nodes * self.procs_per_node
        round_.resume_step = latest_step(self.run_dir)
        self.done = [*self.done, round_][-MAX_ROUNDS:]
        nodes = ", ".join(f"{i} ({self.hosts[i]})" for i in sorted(round_.members, key=round_.members.__getitem__))
        self.sink(f"[dtrain] round {round_.round}: {round_.nodes} node(s) [{nodes}], world size {round_.world_size}, "
                  f"from step {round_.resume_step}")
        if self.on_round is not None:
            self.on_round(round_)

    def to_list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.to_dict() for r in self.done]


def latest_step(run_dir: str) -> int:
    """The step of the job's latest checkpoint (0: none), read as the Training tab reads it."""
    try:
        found = RunDir(run_dir).checkpoints()
    except (UnsafeRunDir, OSError, ValueError):
        return 0
    return found[-1]["step"] if found else 0


class Membership:
    """Which nodes of an elastic job run, are lost, succeeded or failed; :meth:`status` at each poll."""

    def __init__(self, min_nodes: int, sink: Callable[[str], None]):
        self.min_nodes, self.sink = min_nodes, sink
        self.lost: dict[int, LostNode] = {}  # node index -> its latest loss (cleared when it returns)
        self.losses: list[LostNode] = []
        self.succeeded: set[int] = set()
        self.failure: tuple[int, int, list[str]] | None = None  # (node, exit code, tail)
        self._seen: set[int] = set()  # id() of the node processes whose end is taken into account

    def scan(self, latest: "dict[int, NodeProcess]", lost_of: Callable[["NodeProcess", int], LostNode | None]) -> int:
        """Account for every node process (the latest one of each node) that ended since the last
        scan; ``lost_of(node, exit code)`` is the verdict when that end means a lost node. Returns how
        many nodes still run."""
        ended = []
        for node in latest.values():
            code = node.proc.poll()
            if code is not None and id(node) not in self._seen:
                self._seen.add(id(node))
                ended.append((node, code))
        running = sum(1 for n in latest.values() if n.proc.poll() is None)
        for node, code in ended:
            verdict = lost_of(node, code)
            if verdict is not None:
                self.node_lost(verdict, running)
            else:
                if node.reader is not None:  # its last lines (why it failed) may still be in the pipe
                    node.reader.join(timeout=5)
                self.node_ended(node.index, code, node.tail)
        return running

    def node_lost(self, verdict: LostNode, running: int) -> None:
        self.lost[verdict.node] = verdict
        self.losses.append(verdict)
        if running >= self.min_nodes:
            self.sink(f"[dtrain] {verdict.message()}; {running} node(s) go on (at least {self.min_nodes}): "
                      f"the next round forms without it")

    def returned(self, node: int) -> None:
        self.lost.pop(node, None)

    def node_ended(self, node: int, code: int, tail: Sequence[str]) -> None:
        if code == 0:
            self.succeeded.add(node)
        elif code == NO_ROUND_EXIT_CODE:
            return  # it ran no round when the job ended: neither success nor failure
        elif self.failure is None:  # before or after a peer's success: a rank that crashes saving fails the job
            self.failure = (node, code, list(tail))

    def status(self, running: int) -> JobStatus | None:
        """The job's status when it is over (None: it goes on). ``running``: nodes whose process still runs."""
        if self.failure is not None:
            node, code, tail = self.failure
            return JobStatus(state="FAILED", done=True, exit_code=code, failed_node=node, tail=tail)
        if self.succeeded:
            return JobStatus(state="COMPLETED", done=True, exit_code=0) if running == 0 else None
        if self.losses and running < self.min_nodes:
            verdict = self.losses[-1]
            self.sink(f"[dtrain] {verdict.message()}; {running} node(s) left, fewer than {self.min_nodes}: "
                      f"the job cannot go on")
            return JobStatus.of_lost_node(verdict)
        if running == 0:
            return JobStatus(state="FAILED", done=True, exit_code=1, reason="every node ended without success")
        return None
