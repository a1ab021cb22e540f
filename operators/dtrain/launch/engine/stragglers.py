"""Straggler and stall verdicts while the job runs, in the task log.

The stall report (:mod:`dtrain.stall_report`) comes at the end of a job; a straggler costs every
step until then (in synchronous DDP every rank waits for it). So the launcher looks every
:data:`POLL_S` seconds at each rank's last :data:`LAST_STEPS` steps (what the job does now, not since
it started: a host that slows after hours is named within seconds) and says so in its log when a
verdict appears, changes (other ranks named) or clears, once two looks in a row agree on it (one busy
stretch of a healthy host, which one look's 50 steps can hold, is not a straggler):

    [straggler] LoadBalancing: TRIGGERED on ranks 2, 3 (node 1): the slowest at 2.85x the median compute time ...

The same rules, over the same records, are in the Training tab (live) and in the result's ``stall``
(XCom, at the end, over the whole job). A look reads the newest :data:`RANK_BYTES` of each rank's file
(through :mod:`dtrain.rundir`: bounded, no link followed): 16 KB a rank every 5 s, 16 MB for a
1000-rank job; the ranks' files are not trusted beyond what the report believes.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from dtrain.stall_report import summarize

#: seconds between looks at the ranks' newest steps (a verdict is said after two looks agree: within
#: 2 x POLL_S of the steps that show it)
POLL_S = 5.0
#: the steps of each rank a look judges (a slow node is named once its late steps make up two thirds of
#: their time: a few of a slowdown's long steps)
LAST_STEPS = 50
#: bytes of each rank's file read in one look: more than LAST_STEPS records (about 250 bytes each)
RANK_BYTES = 16 * 1024
#: steps each rank must have in a look (after the report's warm-up steps) before anything is said: the
#: first looks of a job hold a handful of steps, and a rank whose host was busy for one of them would
#: be named (on the test cluster under load: a verdict before any host was slowed)
MIN_STEPS = 20
#: the rules a verdict can come from
RULES = ("LoadBalancing", "CommunicationBound", "CPUBottleneck")


def verdict_key(summary: dict[str, Any]) -> tuple:
    """What makes two looks the same verdict: which rules fired, and on which ranks."""
    rules = summary.get("rules") or {}
    return tuple((name, tuple(rules[name].get("ranks") or ())) for name in RULES
                 if name in rules and rules[name].get("triggered"))


def window(metrics_dir: str) -> dict:
    """The stall report over what the watch looks at: each rank's last LAST_STEPS steps (RANK_BYTES at most)."""
    return summarize(metrics_dir, window_bytes=RANK_BYTES, last_steps=LAST_STEPS)


class StragglerWatch:
    """A daemon thread beside whatever waits for the job (the launcher); ``stop`` ends it."""

    def __init__(self, metrics_dir: str, sink: Callable[[str], None], interval: float = POLL_S):
        self.metrics_dir, self.sink, self.interval = metrics_dir, sink, interval
        self.last: tuple = ()  # the verdict said last
        self.seen: tuple = ()  # the previous look's verdict
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "StragglerWatch":
        self._thread = threading.Thread(target=self._run, name="dtrain-straggler-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.look()
            except Exception as e:  # a rank's files must never end the job or the watch
                self.sink(f"[straggler] no look: {type(e).__name__}: {e}")

    def look(self) -> None:
        """One look; logs the verdicts when this look and the one before agree on them and they differ from what
        was said last."""
        summary = window(self.metrics_dir)
        ranks = summary.get("ranks") or ()
        if len(ranks) < 2 or min(r["steps"] for r in ranks) < MIN_STEPS:
            return
        key, previous = verdict_key(summary), self.seen
        self.seen = key
        if key == self.last or key != previous:
            return  # nothing new, or new in this look only
        if key:
            for name, _ in key:
                self.sink(f"[straggler] {name}: {summary['rules'][name]['message']}")
        else:
            self.sink("[straggler] no straggler or stall any more: "
                      + "; ".join(f"{name} {summary['rules'][name]['message']}" for name, _ in self.last))
        self.last = key
