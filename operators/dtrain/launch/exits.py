"""Which rank failed first, from the ranks' exit records (written by dtrain.launch.rank_entry).

Stdlib only: the launcher and the Training tab's API both read exit records.
"""

from __future__ import annotations

from typing import Any, Iterable


def first_failure_of(records: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The record of the rank that failed first on its own: a nonzero exit not caused by a stop
    signal from its agent or from us (those ranks were taken down by the failure, not its cause)."""
    failed = [r for r in records if r.get("exit_code") and not r.get("stopped_by_signal")
              and isinstance(r.get("time"), (int, float))]
    return min(failed, key=lambda r: r["time"]) if failed else None
