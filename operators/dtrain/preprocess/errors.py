"""Errors of the preprocessing step (all :class:`~dtrain.errors.DTrainError`)."""

from __future__ import annotations

from dtrain.errors import DTrainError


class PreprocessError(DTrainError):
    """Preprocessing could not produce a dataset (unreadable input, inconsistent fields, bad shard)."""


class TooManyBadRecords(PreprocessError):
    """More records failed to parse or transform than ``max_bad_fraction`` allows; nothing was published."""

    def __init__(self, bad: int, records: int, max_bad_fraction: float, quarantine: str, where: str = "dataset"):
        self.bad = bad
        self.records = records
        self.max_bad_fraction = max_bad_fraction
        self.quarantine = quarantine
        fraction = bad / records if records else 1.0
        super().__init__(
            f"{where}: {bad} of {records} records are bad ({fraction:.4%}), above max_bad_fraction="
            f"{max_bad_fraction} ({max_bad_fraction:.4%}); no manifest was published. "
            f"See {quarantine} for each bad record's file, line and reason.")


class RecordTooLarge(ValueError):
    """One input record is above ``max_record_bytes``: it is quarantined (a bad record), never parsed."""
