"""The data-stall report's former path, kept so that code written against it keeps working
(docs/preprocess.md showed ``from dtrain.training.stall_report import format_report, summarize``).

The report lives in :mod:`dtrain.stall_report`: the launcher writes it after every job and the
Training tab reads it, and the launch package must not import the training package. Nothing
here but the re-export.
"""

from dtrain.stall_report import format_report, summarize, summarize_records

__all__ = ["format_report", "summarize", "summarize_records"]
