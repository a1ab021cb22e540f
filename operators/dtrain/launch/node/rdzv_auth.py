"""What an elastic job's rendezvous believes: only values signed with the job's secret.

The rendezvous store (:mod:`dtrain.launch.core.rdzv_store`) is a TCPStore: it has no access
control, and anyone who reaches its port can read and write any key. So nothing read there is
believed, or unpickled, unless it carries a MAC that verifies:

* HMAC-SHA256, keyed with the job's secret (64 hex digits, made by the launcher), over the key's
  name and the value: a value cannot be moved to another key, and another job's values do not
  verify; compared in constant time (both: :mod:`dtrain.launch.node.job_secret`).
* The secret reaches the store process and each agent on its stdin (one JSON line,
  ``{"secret": "<64 hex>"}``, :func:`read_secret`), never in an argv, an environment, a file or a
  log; the agent then points its stdin at /dev/null, so its workers (the ranks) inherit nothing.
* A value that fails is refused before anything else reads it: :meth:`StoreKey.open` raises
  :class:`Tampered`, and the caller counts it and names the key in the log (:meth:`StoreKey.refuse_once`).

Signing does not make the store private: whoever reaches the port can still delete or overwrite
keys, or replay a value signed earlier (each reader guards against replay where it matters: see
:mod:`dtrain.launch.node.elastic_rdzv`). What it does stop: a planted value being believed.

The same key signs each agent's round lines (:func:`round_mac`), so that a rank printing a round
line into a shared log (Slurm's) cannot forge one. Stdlib only.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from dtrain import grammar
from dtrain.launch.node.job_secret import mac, mac_matches, read_stdin_line

#: the signed form of a value: ``<64 hex MAC>:<value>``
MAC_LEN = 64


class Tampered(ValueError):
    """A value in the store that this job's rendezvous did not write (its MAC does not verify)."""


def read_secret(fd: int = 0, close: bool = True) -> str:
    """The job's secret, from one JSON line on ``fd`` (``{"secret": "<64 hex>"}``); then ``fd`` points
    at /dev/null (``close``), so that no child reads anything there. ValueError when the line is not that."""
    data = read_stdin_line(fd, close=close)
    try:
        secret = json.loads(data).get("secret")
    except (ValueError, AttributeError) as e:
        raise ValueError("no secret line on stdin") from e
    if not isinstance(secret, str) or grammar.SECRET.fullmatch(secret) is None:
        raise ValueError("the secret on stdin is not 64 lowercase hex digits")
    return secret


def secret_line(secret: str) -> bytes:
    """The stdin line :func:`read_secret` reads."""
    return (json.dumps({"secret": secret}) + "\n").encode()


@dataclass
class StoreKey:
    """The job's secret, as the rendezvous uses it: signs and verifies the store's values."""

    secret: str = field(repr=False)
    refusals: int = 0  # values refused so far (each one named in the log)

    def __post_init__(self):
        if grammar.SECRET.fullmatch(self.secret) is None:
            raise ValueError("the job's secret must be 64 lowercase hex digits")
        self._key = bytes.fromhex(self.secret)
        self._refused: dict[str, bytes] = {}  # key -> the value last refused there (logged once)

    @staticmethod
    def _signed_part(name: str, value: bytes) -> bytes:
        return name.encode() + b"\0" + value  # what the MAC of key ``name``'s value covers

    def seal(self, name: str, value: bytes) -> bytes:
        """``value`` signed for key ``name``."""
        return mac(self._key, self._signed_part(name, value)).encode() + b":" + value

    def open(self, name: str, signed: bytes) -> bytes:
        """The value of key ``name`` if its MAC verifies, else :class:`Tampered`."""
        given, sep, value = bytes(signed).partition(b":")
        if sep != b":" or len(given) != MAC_LEN or not mac_matches(self._key, self._signed_part(name, value), given):
            raise Tampered(f"the value of {name!r} is not signed by this job's rendezvous")
        return value

    def open_or_refuse(self, name: str, signed: bytes) -> bytes | None:
        """:meth:`open`, or None for a value that does not verify (refused: :meth:`refuse_once`)."""
        try:
            return self.open(name, signed)
        except Tampered as e:
            self.refuse_once(name, signed, str(e))
            return None

    def refuse_once(self, name: str, signed: bytes, why: str) -> None:
        """Count a refused value and name it in the log (stderr: the job's log), once per planted value
        (the readers poll: a value that stays there is one refusal)."""
        if self._refused.get(name) == bytes(signed):
            return
        self._refused[name] = bytes(signed)
        self.refusals += 1
        print(f"[dtrain] rendezvous store: refused the value of {name!r} ({why}): store tampering, "
              f"ignored ({self.refusals} refused so far)", file=sys.stderr, flush=True)

    def round_mac(self, line: str) -> str:
        """The MAC that ends an agent's round line (:func:`dtrain.launch.node.elastic_rdzv.round_line`)."""
        return mac(self._key, self._signed_part("dtrain.round", line.encode()))

    def round_ok(self, line: str, given: str) -> bool:
        return mac_matches(self._key, self._signed_part("dtrain.round", line.encode()), given)
