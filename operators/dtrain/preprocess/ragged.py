"""Variable-length fields: every sample of a field in one 1-D ``values`` array, cut by ``offsets``.

Sample i is ``values[offsets[i]:offsets[i + 1]]``. On disk both are ``.npy`` files, memory-mapped
like the fixed-shape fields; what arrow, MDS and LitData call a list column is the same layout.
This module is the one place that builds them (the writer), checks them (the reader: shard files
are untrusted), gathers a batch of them and collates it (a list, or padded with a mask). numpy only.

A ``Ragged`` may be a window of a larger one (``offsets[0]`` need not be 0): slicing a block of
batches into batches then copies nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtrain.preprocess.errors import PreprocessError

#: offsets are checked this many at a time: a shard of millions of samples is never diffed whole
CHECK_BLOCK = 1 << 20


@dataclass(frozen=True)
class Ragged:
    values: np.ndarray  # 1-D
    offsets: np.ndarray  # int64, one more than the samples, non-decreasing

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def data(self) -> np.ndarray:
        """The values of these samples, contiguous (a view)."""
        return self.values[self.offsets[0]:self.offsets[-1]]

    def rows(self, start: int, stop: int) -> "Ragged":
        """Samples start..stop-1 as a view: nothing is copied."""
        return Ragged(self.values, self.offsets[start:stop + 1])

    def lengths_of(self, rows: np.ndarray) -> np.ndarray:
        return self.offsets[rows + 1] - self.offsets[rows]


def from_samples(samples: list[np.ndarray], dtype: np.dtype) -> Ragged:
    """The writer's side: 1-D arrays of one dtype -> values (native byte order) + offsets from 0."""
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in samples], out=offsets[1:])
    native = np.dtype(dtype.name)
    values = np.concatenate(samples).astype(native, copy=False) if samples else np.empty(0, native)
    return Ragged(values, offsets)


def check(values: np.ndarray, offsets: np.ndarray, num_samples: int, max_length: int, where: str) -> None:
    """Refuse offsets that would read outside ``values`` or past the manifest's ``max_length``.

    ``where`` names the field and its files. After this, any row of the pair can be sliced
    without a bound check: offsets start at 0, never decrease, end at ``len(values)``.
    """
    if values.ndim != 1:
        raise PreprocessError(f"{where}: values must be a 1-D array, got shape {values.shape}")
    if offsets.ndim != 1 or offsets.dtype.kind != "i" or offsets.dtype.itemsize != 8:
        raise PreprocessError(f"{where}: offsets must be a 1-D int64 array, got {offsets.dtype} {offsets.shape}")
    if len(offsets) != num_samples + 1:
        raise PreprocessError(f"{where}: {len(offsets)} offsets for {num_samples} samples; "
                              f"allowed: exactly one more than the samples ({num_samples + 1})")
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != len(values):
        raise PreprocessError(f"{where}: offsets run from {first} to {last}; allowed: from 0 to the values' "
                              f"length {len(values)}")
    for start in range(0, num_samples, CHECK_BLOCK):
        lengths = np.diff(offsets[start:start + CHECK_BLOCK + 1])
        bad = np.flatnonzero((lengths < 0) | (lengths > max_length))
        if bad.size:
            i = int(bad[0])
            raise PreprocessError(f"{where}: sample {start + i} has length {int(lengths[i])} (offsets "
                                  f"{int(offsets[start + i])} -> {int(offsets[start + i + 1])}); allowed: "
                                  f"0 to max_length={max_length} (offsets must not decrease)")


#: from this mean sample length up, a batch is gathered with one slice copy per sample; below it, with one
#: fancy index over every value (a Python step per sample costs about what 60 index entries do)
SLICE_MIN_MEAN = 48


def gather(parts: list[tuple[Ragged, np.ndarray | None, np.ndarray]], n: int, dtype: np.dtype) -> Ragged:
    """``n`` samples taken from one or more sources into one new contiguous Ragged.

    ``parts`` lists (source, positions in the output or None for 0..n-1 in order, rows of the source).
    Long samples are copied slice by slice (a memcpy each); short ones with one fancy index for the
    whole part (no per-sample Python work), which costs an index entry per value instead.
    """
    lengths = np.empty(n, dtype=np.int64)
    for source, positions, rows in parts:
        lengths[slice(None) if positions is None else positions] = source.lengths_of(rows)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    native = np.dtype(np.dtype(dtype).name)
    if n and offsets[-1] >= SLICE_MIN_MEAN * n:
        pieces: list = [None] * n
        for source, positions, rows in parts:
            order = range(n) if positions is None else positions.tolist()
            for p, a, b in zip(order, source.offsets[rows].tolist(), source.offsets[rows + 1].tolist()):
                pieces[p] = source.values[a:b]
        return Ragged(np.concatenate(pieces).astype(native, copy=False), offsets)
    values = np.empty(int(offsets[-1]), dtype=native)
    for source, positions, rows in parts:
        part_lengths = source.lengths_of(rows)
        ends = np.cumsum(part_lengths)
        inside = np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) - np.repeat(ends - part_lengths,
                                                                                         part_lengths)
        where = slice(None) if positions is None else np.repeat(offsets[positions], part_lengths) + inside
        values[where] = source.values[np.repeat(source.offsets[rows], part_lengths) + inside]
    return Ragged(values, offsets)


def join_offsets(parts: list[np.ndarray]) -> np.ndarray:
    """Offsets of whole shards laid end to end (each starting at 0): each shifted by the values before it."""
    out = np.zeros(1 + sum(len(p) - 1 for p in parts), dtype=np.int64)
    at, base = 1, 0
    for offsets in parts:
        out[at:at + len(offsets) - 1] = offsets[1:] + base
        at += len(offsets) - 1
        base += int(offsets[-1])
    return out


def split(batch: Ragged) -> list[np.ndarray]:
    """One view per sample into the batch's values (no copy)."""
    return np.split(batch.data(), (batch.offsets[1:-1] - batch.offsets[0]).tolist())


def pad(batch: Ragged, pad_value: float | int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[samples, longest] values padded with ``pad_value``, and the mask of real values (True).

    Raises OverflowError when ``pad_value`` does not fit the values' dtype."""
    lengths = batch.lengths
    width = int(lengths.max(initial=0))
    dtype = np.dtype(batch.values.dtype.name)
    fill = np.full((), pad_value, dtype=dtype)  # refuses a value the dtype cannot hold, before any work
    mask = np.arange(width) < lengths[:, None]
    if len(batch) and int(lengths.sum()) >= SLICE_MIN_MEAN * len(batch):  # long rows: a slice copy each
        out = np.empty((len(batch), width), dtype=dtype)
        for row, a, b in zip(out, batch.offsets[:-1].tolist(), batch.offsets[1:].tolist()):
            row[:b - a] = batch.values[a:b]
            row[b - a:] = fill
        return out, mask
    out = np.full((len(batch), width), fill, dtype=dtype)
    out[mask] = batch.data()  # a row's True cells come first and rows follow each other: values' own order
    return out, mask
