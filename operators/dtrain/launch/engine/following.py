"""Follow a job submitted earlier, by this process or by one that is gone: the launcher's side of
durable mode (:meth:`dtrain.launch.engine.launcher.Launcher.attach`).

A retry after a worker crash re-attaches to the job its earlier try submitted (the operator's
bookkeeping: :mod:`dtrain.launch.airflow.resumable`); the launcher then follows it as if it had
started it, through :class:`Following`. No Airflow import.
"""

from __future__ import annotations

from typing import Any, Callable

from dtrain.errors import DTrainError, LaunchError
from dtrain.launch.backends import Backend, BackendOutcome, JobHandle
from dtrain.launch.engine.submission import DEFAULT_POLL_INTERVAL, taken_over
from dtrain.launch.node.lease import LOST_EXIT_CODE

TAIL_LINES = 40


class Following:
    """A backend whose ``run(job)`` follows the submitted job ``handle`` names instead of starting
    one: :meth:`Backend.watch` of that handle (what :meth:`Backend.run` does after its submit). Everything
    else is the wrapped backend's, so
    :class:`~dtrain.launch.engine.launcher.Launcher` (its watch, ``terminate``, result) works unchanged.
    ``follower``: the try of the task that follows it (the follower record,
    :func:`~dtrain.launch.engine.submission.write_follower`); a stop of this one leaves the job to a later
    try that follows it, and :meth:`leave` stops following without stopping the job."""

    def __init__(self, backend: Backend, handle: JobHandle, follower: int | None = None):
        self.backend = backend
        self.handle = handle
        self.follower = follower
        self.left = ""  # why the job is left running, once leave() was called
        self.state = ""  # the job's final state, once it ended
        self.lines = 0  # output lines the backend streamed while following
        self.grace: float | None = None  # set by terminate(grace): how long the ranks get at the cancel

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def terminate(self, grace: float | None = None) -> None:
        self.grace = grace
        self.backend.terminate(grace)

    def leave(self, why: str) -> None:
        """Stop following, leaving the job running (``why``: who follows it instead). Safe from signal handlers."""
        self.left = why
        self.backend.terminate()

    def _kept(self) -> str:
        later = taken_over(self.handle, self.follower)
        return self.left or (f"try {later} follows it now" if later is not None else "")

    def run(self, job: Any = None) -> BackendOutcome:
        backend, handle = self.backend, self.handle
        # Remote polls (scontrol, ssh to every host) at the pace the submission chose, not the
        # local default: the re-attaching backend never ran submit().
        backend.poll_interval = float(handle.data.get("poll_interval", DEFAULT_POLL_INTERVAL))
        sink = backend.sink
        backend.sink = self._counting(sink)
        try:
            outcome = backend.watch(handle, self.grace, self._kept)
        except DTrainError as e:  # lost track: the backend could not be asked, poll after poll
            self.state = "LOST"
            raise LaunchError(str(e), LOST_EXIT_CODE, state=self.state) from e
        finally:
            backend.sink = sink
        self.state = outcome.state
        if not outcome.stopped and not self.lines:  # a backend that does not stream (detached SSH): its last lines
            for line in backend.logs(handle, TAIL_LINES):
                sink(line)
        return outcome

    def _counting(self, sink: Callable[[str], Any]) -> Callable[[str], Any]:
        def emit(line: str) -> None:
            self.lines += 1
            sink(line)
        return emit
