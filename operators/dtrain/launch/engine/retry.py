"""Which failures a retry can fix: a pure classification of the exception a training task raised.

No Airflow import: :mod:`dtrain.launch.airflow.retry_policy` turns a :class:`Verdict` into Airflow's
``RetryDecision``; the CLI or another orchestrator can use :func:`classify` as it is.

* ``fail`` -- bad input (:class:`~dtrain.errors.SpecError`: a bad field, a refused DeepSpeed
  config...). The same input fails the same way on every try, so retrying only wastes time.
* ``retry`` -- the job was cut short by its surroundings, not by its own code: preempted
  (stopped by SIGTERM, exit 143, Slurm ``PREEMPTED``), a lost node (ssh exit 255, Slurm
  ``NODE_FAIL``, a node agent gone or unreachable), a broken collective (the failed rank's last
  lines show a gloo/NCCL communication error), a hang or time limit (exit 124). A retry resumes
  from the last checkpoint in the same run directory.
* ``default`` -- anything else (a traceback in the training script, OOM...): the task's own
  ``retries`` decide, as without a policy.

The failed rank's tail is rank output, which is untrusted: it can only turn ``default`` into
``retry``, which Airflow still bounds by the task's ``retries``; it can never cause ``fail`` or
add a try. Patterns are matched as plain substrings, never compiled from the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dtrain.errors import LaunchError, SpecError
from dtrain.launch.core.exits import communication_error  # the one list of those patterns
from dtrain.launch.engine.hang import HANG_EXIT_CODE  # a hung job torn down (also Slurm's TIMEOUT: a time limit)
from dtrain.launch.node.lease import LOST_EXIT_CODE  # ssh's code for a lost connection, and a lost node's

FAIL, RETRY, DEFAULT = "fail", "retry", "default"

SIGTERM_EXIT_CODE = 143  # 128 + SIGTERM: stopped from outside (preemption, eviction, spot reclaim)

PREEMPTED_STATES = frozenset({"PREEMPTED"})
LOST_NODE_STATES = frozenset({"NODE_FAIL", "BOOT_FAIL", "LOST"})
# A person (or an admin script) cancelled it: not a fault of the infrastructure.
CANCELLED_STATES = frozenset({"CANCELLED"})


@dataclass(frozen=True)
class Verdict:
    """``action``: :data:`FAIL` | :data:`RETRY` | :data:`DEFAULT`; ``reason``: one line for the log
    and for the task instance's ``retry_reason``."""

    action: str
    reason: str


def classify(error: BaseException) -> Verdict:
    """The verdict for ``error`` (the exception the task raised, its causes included)."""
    spec_error = _find(error, SpecError)
    if spec_error is not None:
        return Verdict(FAIL, f"bad input, a retry would fail the same way: {spec_error}")
    launch_error = _find(error, LaunchError)
    if launch_error is None:
        return Verdict(DEFAULT, f"{type(error).__name__}: not a launch failure")
    return classify_launch(launch_error.exit_code, launch_error.state, launch_error.tail)


def classify_launch(exit_code: int | None, state: str | None, tail: Sequence[str]) -> Verdict:
    """The verdict for a failed launch from what it reported: exit code, backend state, the failed
    rank's (or the job's) last lines."""
    state = (state or "").upper()
    if state in CANCELLED_STATES:
        return Verdict(DEFAULT, f"cancelled (state {state})")
    if exit_code == HANG_EXIT_CODE:
        what = "hit its time limit" if state == "TIMEOUT" else "hung (no progress) and was torn down"
        return Verdict(RETRY, f"transient: the job {what} (exit {exit_code}); a retry resumes from its checkpoint")
    if state in PREEMPTED_STATES or exit_code == SIGTERM_EXIT_CODE:
        return Verdict(RETRY, f"transient: preempted, the job was stopped by SIGTERM ({_where(exit_code, state)})")
    if state in LOST_NODE_STATES or exit_code == LOST_EXIT_CODE:
        return Verdict(RETRY, f"transient: a node or its connection was lost ({_where(exit_code, state)})")
    line = communication_error(tail)
    if line is not None:
        return Verdict(RETRY, f"transient: communication error between ranks: {line[:200]}")
    return Verdict(DEFAULT, f"no transient cause recognised ({_where(exit_code, state)})")


def _where(exit_code: int | None, state: str) -> str:
    return f"exit {exit_code}" + (f", state {state}" if state else "")


def _find(error: BaseException, kind: type) -> BaseException | None:
    """``error`` or the first of its explicit causes (``raise ... from``) that is a ``kind``: a
    wrapped SpecError still means bad input. Bounded: a cycle in the chain cannot loop."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__
    return None


__all__ = ["Verdict", "classify", "classify_launch", "FAIL", "RETRY", "DEFAULT"]
