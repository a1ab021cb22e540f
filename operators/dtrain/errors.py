"""One base class for every error the product raises, so callers can catch them together."""

from __future__ import annotations


class DTrainError(Exception):
    """Base class of every error raised by airflow-dtrain."""


class SpecError(DTrainError, ValueError):
    """A user-supplied value is invalid. Raised before anything expensive starts.

    The message names the field, the value given and what is allowed.
    """

    def __init__(self, field: str, value: object, allowed: str):
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r} is invalid: {allowed}")

    def __reduce__(self):
        # Rebuilt from its three fields (it crosses process boundaries: pools, Airflow's task runner).
        return type(self), (self.field, self.value, self.allowed)


class LaunchError(DTrainError):
    """A launched job failed. Carries the failing rank's exit code and output tail, and the
    backend's final job state when it reports one (``PREEMPTED``, ``NODE_FAIL``, ``LOST``...):
    what :mod:`dtrain.launch.engine.retry` reads to decide whether a retry can help."""

    def __init__(self, message: str, exit_code: int, rank: int | None = None, tail: list[str] | None = None,
                 state: str | None = None):
        self.summary = message
        self.exit_code = exit_code
        self.rank = rank
        self.tail = list(tail or [])
        self.state = state
        detail = "\n".join(self.tail)
        source = f"rank {rank}" if rank is not None else "the job"
        super().__init__(message + (f"\nlast lines of {source}:\n{detail}" if detail else ""))

    def __reduce__(self):
        # Rebuilt from its fields, not from the formatted message (it may cross process boundaries).
        return type(self), (self.summary, self.exit_code, self.rank, self.tail, self.state)
