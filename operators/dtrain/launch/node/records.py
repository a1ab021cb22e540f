"""A node's records in the run directory, authenticated with the job's secret and checked field by field.

A detached SSH job is watched through files in its run directory
(:mod:`dtrain.launch.backends.ssh.detached_node`): the daemon's ``state`` record (which process it is)
and its ``exit`` record (how the node ended); a node's lease holder (:mod:`dtrain.launch.node.lease`)
writes ``beat`` and ``fence`` records there. The ranks can write anything there, so a record decides
nothing unless

* its MAC verifies: HMAC-SHA256, keyed with the job's secret (64 hex digits, made by the launcher
  and handed to the daemon over the ssh session's stdin, never through an argv, the ranks'
  environment or the run directory), over the record's canonical JSON (sorted keys, no blanks,
  ASCII, no NaN/Infinity), which names its kind, job and node: a record cannot be replayed as
  another kind, for another node or from another job; compared in constant time
  (:mod:`dtrain.launch.node.job_secret`);
* and then every field has the type and range the daemon writes (a signed record is still parsed
  strictly: a daemon of another version must not crash a watcher either).

Anything else raises :class:`RecordError` with the reason, which callers report (the record is
ignored, never read as a success). The daemon runs as the ranks' user: this stops a rank that can
write files, not one that reads the daemon's memory (see docs/security.md).

Here, in ``node/``, because both sides use it: the node-side writers (the daemon, the lease holder)
and the launcher's readers. Stdlib only (the daemon imports it on every host).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from dtrain import grammar
from dtrain.errors import SpecError
from dtrain.launch.node.job_secret import mac, mac_matches

#: the job's secret: 32 random bytes as lowercase hex
SECRET = grammar.SECRET
#: what the daemon's exit code can be: an exit status, or 128 + a signal number
MAX_EXIT_CODE = 255
MAX_SIGNAL = 64
#: what a fence's reason may hold (it is read back as untrusted): a fence record's, an exit record's
FENCE_REASON_LIMIT = 500


class RecordError(ValueError):
    """A record that is not the daemon's, or not what the daemon writes: the reason says which."""


def canonical(value: dict[str, Any]) -> bytes:
    """The one byte string a record's MAC covers (RecordError for a value JSON cannot hold exactly)."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise RecordError(f"not plain JSON ({e})") from e


def parse(raw: bytes) -> Any:
    """A record's JSON value (RecordError when it is not JSON: also when nested too deep to parse)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise RecordError(f"not JSON ({type(e).__name__})") from e


@dataclass(frozen=True)
class JobKey:
    """The job's id and secret: signs the daemon's records, verifies them for any reader."""

    job_id: str
    secret: str

    def __post_init__(self):
        if not isinstance(self.secret, str) or SECRET.fullmatch(self.secret) is None:
            raise SpecError("secret", "<not shown>", "64 lowercase hex digits")

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return f"JobKey(job_id={self.job_id!r})"

    def _mac(self, body: dict[str, Any]) -> str:
        return mac(bytes.fromhex(self.secret), canonical(body))

    def sign(self, kind: str, node: int, fields: dict[str, Any]) -> dict[str, Any]:
        body = {**fields, "kind": kind, "job_id": self.job_id, "node": node}
        return {**body, "mac": self._mac(body)}

    def verify(self, kind: str, node: int, value: Any) -> dict[str, Any]:
        """``value`` without its MAC if it is this job's ``kind`` record for ``node``, checked field by
        field; else RecordError."""
        if not isinstance(value, dict) or not isinstance(value.get("mac"), str):
            raise RecordError("not signed (no MAC)")
        body = {k: v for k, v in value.items() if k != "mac"}
        if not mac_matches(bytes.fromhex(self.secret), canonical(body), value["mac"]):
            raise RecordError("its MAC does not verify: not written by this job's daemon")
        if (body.get("kind"), body.get("job_id"), body.get("node")) != (kind, self.job_id, node):
            raise RecordError(f"signed for another record ({body.get('kind')!r} of node {body.get('node')!r})")
        return check(kind, body)


def _integer(low: int, high: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _optional(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or test(value)


#: each kind's fields and what each may hold (what the daemon writes, nothing else)
FIELDS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "state": {"pid": _integer(2, 2 ** 22), "create_time": _number,
              "host": lambda v: isinstance(v, str) and len(v) <= 255},
    "exit": {"exit_code": _integer(0, MAX_EXIT_CODE),
             "stopped_by_signal": _optional(_integer(1, MAX_SIGNAL)), "time": _number},
    # a node lease holder's records (dtrain.launch.node.lease)
    "beat": {"time": _number},
    "fence": {"time": _number, "reason": lambda v: isinstance(v, str) and len(v) <= FENCE_REASON_LIMIT},
}
#: fields a record may lack (a daemon of an earlier version writes none of them)
OPTIONAL_FIELDS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "exit": {"fenced": _optional(lambda v: isinstance(v, str) and len(v) <= FENCE_REASON_LIMIT)},  # why the node fenced itself
}


def check(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` if each of ``kind``'s fields is there with a value of its type and range, else RecordError."""
    for name, ok in FIELDS[kind].items():
        if name not in body or not ok(body[name]):
            raise RecordError(f"{name}={body.get(name)!r} is not what the daemon writes")
    for name, ok in OPTIONAL_FIELDS.get(kind, {}).items():
        if name in body and not ok(body[name]):
            raise RecordError(f"{name}={str(body[name])[:100]!r} is not what the daemon writes")
    return body
