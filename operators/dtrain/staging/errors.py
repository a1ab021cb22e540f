"""Errors raised by staging. All derive from DTrainError so callers catch them together."""

from __future__ import annotations

from dtrain.errors import DTrainError, SpecError

__all__ = ["StagingError", "UnsafeKeyError", "DestinationError", "VerifyError", "StagingCancelled", "ThroughputError",
           "SpecError"]


class StagingError(DTrainError):
    """A stage could not complete (source missing or empty, access denied, a file failed)."""

    exit_code = 1


class UnsafeKeyError(StagingError):
    """A source key would land outside the destination (or on a name staging reserves).

    Bad input (the source's layout), refused before anything is created: exit status 2."""

    exit_code = 2

    def __init__(self, key: str, reason: str):
        self.key = key
        super().__init__(f"refusing source key {key!r}: {reason}; nothing was copied")


class DestinationError(StagingError):
    """The destination cannot be written (not a directory, read-only, no permission): the user's
    input, refused before anything is created in it, so exit status 2."""

    exit_code = 2


class VerifyError(StagingError):
    """Downloaded bytes do not match what the object store says the object is."""


class StagingCancelled(StagingError):
    """The stage was cancelled (on_kill, SIGTERM); temporary files were removed."""


class ThroughputError(StagingError):
    """Measured staging throughput is below what training needs, and the user asked to fail."""
