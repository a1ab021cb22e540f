"""``python -m operators.job``: the same as train.py, started as a module of the user's package."""

from operators.helpers import write_record

print("wrote", write_record("module"))
