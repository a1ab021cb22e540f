"""Read preprocessed shards in a training script: memory-mapped, split by rank.

    from dtrain.training.shards import ShardDataset, ShardSampler

    dataset = ShardDataset("/fsx/digits/2024-01-01")            # items are (x, y) tensors
    sampler = ShardSampler(len(dataset), seed=0)                 # rank and world size from the env
    loader = ShardLoader(dataset, batch_size=32, sampler=sampler)  # or DataLoader(dataset, ..., sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            ...

ShardLoader reads several batches with one gather per field and hands out slices, so a
step waits microseconds for its data; a plain DataLoader works too (the dataset has a
batched ``__getitems__``), at the cost of collating samples for every batch.

Each shard's field files are ``.npy`` arrays opened with ``np.load(mmap_mode="r")``:
nothing is decoded, the page cache (or the shared filesystem's client cache) does the I/O,
and a batch is one fancy index per field. Files are mapped lazily in each process, so
DataLoader workers map their own.

Variable-length fields (token ids, encoded bytes) are a values file and an offsets file
(:mod:`dtrain.preprocess.ragged`), mapped the same way; a batch is again one fancy index per
shard, then a list of views or a padded array with its mask::

    dataset = ShardDataset("/fsx/text/2024-01-01", fields=("input_ids",))
    loader = ShardLoader(dataset, 32, sampler, collate="pad")   # each batch: (Padded(values, mask),)

Shard files and manifests are untrusted input: the manifest is checked whole when the dataset
is opened (:func:`dtrain.preprocess.shardfmt.check_manifest`), and every shard file's dtype,
shape and offsets against it when it is first mapped (``ShardDataset._open_column``).
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Iterator, Mapping, NamedTuple, Sequence, Union

from dtrain.preprocess import ragged
from dtrain.preprocess.errors import PreprocessError
from dtrain.preprocess.ragged import Ragged
from dtrain.preprocess.shardfmt import BYTES, file_keys, file_sha256, load_manifest


DEFAULT_CACHE_BYTES = 32 << 20
DEFAULT_READ_AHEAD_BYTES = 512 << 10
DEFAULT_MAX_SAMPLE_BYTES = 64 << 20
COLLATES = ("list", "pad")
PadValue = Union[float, Mapping[str, float]]


class Padded(NamedTuple):
    """A variable-length field's batch with ``collate="pad"``: ``values`` [batch, longest sample] filled
    with ``pad_value`` past each sample's end, and ``mask`` (bool, same shape: True on real values)."""

    values: Any
    mask: Any


def _values_dtype(spec: dict[str, Any]):
    import numpy as np

    return np.dtype(np.uint8 if spec["dtype"] == BYTES else spec["dtype"])


def check_collate(collate: str) -> str:
    if collate not in COLLATES:
        raise ValueError(f"collate={collate!r} is invalid: 'list' (a list of samples per variable-length field) "
                         f"or 'pad' (a Padded(values, mask) per variable-length field)")
    return collate


class ShardDataset:
    """A map-style torch dataset over a published shard directory (one with ``manifest.json``).

    Args:
        directory: the dataset directory (local or a mounted shared filesystem).
        fields: which fields make an item, in order (default ``("x", "y")``).
        verify: recompute every shard's SHA-256 against the manifest before use.
        cache_bytes: when the chosen fields of the whole dataset fit in this many bytes (default
            32 MiB), each process reads them once into one contiguous array per field (a
            sequential read of the shards), and a batch is then a single gather per field. Larger
            datasets stay memory-mapped shard by shard (one gather per shard a batch touches): their
            pages are the page cache's, shared by every rank on the node, not a private copy per
            process. 0 = always map.
        max_sample_bytes: the largest sample of a field this reader accepts (default 64 MiB): a
            manifest whose field claims more is refused before any shard is read, and so is a shard
            whose offsets make a sample longer than its manifest's ``max_length``. A batch then holds
            at most batch size x this many bytes per field.

    A fixed-shape field of an item is a tensor; a variable-length one is a 1-D tensor (or ``bytes``
    for a field of dtype "bytes"). :meth:`get_batch` gives a variable-length field as a list of them
    (``collate="list"``) or as :class:`Padded` (``collate="pad"``).
    """

    def __init__(self, directory: str, fields: Sequence[str] = ("x", "y"), verify: bool = False,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES):
        self.directory = os.path.abspath(directory)
        self.manifest = load_manifest(self.directory)  # checked: every rule below relies on it
        missing = [f for f in fields if f not in self.manifest["fields"]]
        if missing:
            raise PreprocessError(f"{self.directory}: fields {missing} are not in the dataset; it has "
                                  f"{sorted(self.manifest['fields'])}")
        self.fields = tuple(fields)
        self.specs = {f: self.manifest["fields"][f] for f in self.fields}
        self.shards = self.manifest["shards"]
        self.offsets = [0]
        for shard in self.shards:
            self.offsets.append(self.offsets[-1] + shard["num_samples"])
        import numpy as np

        self.nbytes = sum(shard["files"][key]["bytes"] for shard in self.shards
                          for f in self.fields for key in file_keys(f, self.specs[f]))
        self.sample_nbytes = sum(self._sample_bytes(f, max_sample_bytes) for f in self.fields)
        self._check_files(verify)
        self._starts = np.asarray(self.offsets[:-1], dtype=np.int64)
        self._maps: dict[tuple[int, str], Any] = {}
        self._pid = os.getpid()
        self.cached = self.nbytes <= cache_bytes
        self._cache: dict[str, Any] = {}

    def _sample_bytes(self, field: str, limit: int) -> int:
        """Bytes of one sample (a variable field: its mean over the dataset), refusing a field whose
        samples may be larger than ``limit``."""
        spec = self.specs[field]
        itemsize = _values_dtype(spec).itemsize
        largest = itemsize * (spec["max_length"] if spec.get("variable") else math.prod(spec["shape"]))
        if largest > limit:
            what = f"max_length={spec['max_length']}" if spec.get("variable") else f"shape={spec['shape']}"
            raise PreprocessError(f"{self.directory}: field {field} has {what} of {spec['dtype']}, {largest} bytes a "
                                  f"sample, above max_sample_bytes={limit}: allowed are samples of at most "
                                  f"max_sample_bytes (raise it if this dataset is trusted)")
        if not spec.get("variable"):
            return largest
        total = sum(shard["files"][key]["bytes"] for shard in self.shards for key in file_keys(field, spec))
        return -(-total // max(1, len(self)))

    def _path(self, shard: int, key: str) -> str:
        return os.path.join(self.directory, self.shards[shard]["files"][key]["path"])

    def _least_bytes(self, key: str, field: str, num: int) -> int:
        """The data a file of ``num`` samples holds at least: what ties the manifest's claims (shapes,
        sample counts) to bytes on disk, so no array this reader allocates is larger than the files."""
        spec = self.specs[field]
        if spec.get("variable"):
            return 8 * (num + 1) if key.endswith(".offsets") else 0
        return num * _values_dtype(spec).itemsize * math.prod(spec["shape"])

    def _check_files(self, verify: bool) -> None:
        for i, shard in enumerate(self.shards):
            for field in self.fields:
                for key in file_keys(field, self.specs[field]):
                    info = shard["files"][key]
                    path = self._path(i, key)
                    try:
                        size = os.path.getsize(path)
                    except OSError as e:
                        raise PreprocessError(f"shard file {path} is missing: {e}") from e
                    if size != info["bytes"]:
                        raise PreprocessError(f"shard file {path} has {size} bytes, manifest says {info['bytes']}")
                    least = self._least_bytes(key, field, shard["num_samples"])
                    if size < least:
                        raise PreprocessError(f"shard file {path} has {size} bytes: too few for the "
                                              f"{shard['num_samples']} samples of field {field} its manifest "
                                              f"entry claims (at least {least})")
                    if verify and file_sha256(path) != info["sha256"]:
                        raise PreprocessError(f"shard file {path} does not match its SHA-256 in the manifest")
            if verify:
                digest = hashlib.sha256()
                for key in sorted(shard["files"]):
                    digest.update(f"{key}:{shard['files'][key]['sha256']}\n".encode())
                if digest.hexdigest() != shard.get("sha256"):
                    raise PreprocessError(f"shard {shard.get('path')}: checksum of its files does not match the "
                                          f"manifest")

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"], state["_cache"] = {}, {}  # each process maps (or caches) the files itself
        return state

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked DataLoader worker: do not share the parent's maps
            self._maps, self._cache, self._pid = {}, {}, os.getpid()

    # -- opening shard files: everything read from them is checked against the manifest here ------------

    @staticmethod
    def _map(path: str):
        import numpy as np

        try:
            # A plain ndarray view of the map: np.memmap's own indexing hooks cost more than the gather.
            return np.load(path, mmap_mode="r", allow_pickle=False).view(np.ndarray)
        except (OSError, ValueError) as e:  # a header that lies about the data's size, a pickled array, ...
            raise PreprocessError(f"shard file {path} is not a .npy file this reader maps: {e}") from e

    def _column(self, shard: int, field: str):
        """A shard's ``field``, memory-mapped and checked: an array (fixed) or a Ragged (variable)."""
        self._check_pid()
        key = (shard, field)
        column = self._maps.get(key)
        if column is None:
            column = self._maps[key] = self._open_column(shard, field)
        return column

    def _open_column(self, shard: int, field: str):
        spec, num = self.specs[field], self.shards[shard]["num_samples"]
        if not spec.get("variable"):
            path = self._path(shard, field)
            array = self._map(path)
            want = (num, *spec["shape"])
            if array.shape != want or array.dtype.name != spec["dtype"]:
                raise PreprocessError(f"shard file {path} holds {array.dtype} {array.shape}, manifest says "
                                      f"{spec['dtype']} {want}")
            return array
        values_path, offsets_path = self._path(shard, f"{field}.values"), self._path(shard, f"{field}.offsets")
        values, offsets = self._map(values_path), self._map(offsets_path)
        if values.dtype.name != _values_dtype(spec).name:
            raise PreprocessError(f"shard file {values_path} holds {values.dtype} values, manifest says field "
                                  f"{field} is {spec['dtype']}")
        ragged.check(values, offsets, num, spec["max_length"], f"field {field}, shard file {offsets_path}")
        return Ragged(values, offsets)

    # -- cached mode: the whole dataset's field in one array ---------------------------------------------

    def _whole(self, field: str):
        """The field of every sample as one array or Ragged (cached mode)."""
        self._check_pid()
        column = self._cache.get(field)
        if column is None:
            column = self._cache[field] = self._read_whole(field)
        return column

    def _read_whole(self, field: str):
        """Read every shard's file of ``field`` straight into one array: one copy of the data, and no
        memory map whose pages would sit in this process's memory next to it while it is filled."""
        import numpy as np

        spec = self.specs[field]
        if not spec.get("variable"):
            out = np.empty((len(self), *spec["shape"]), dtype=spec["dtype"])
            for i in range(len(self.shards)):
                self._read_into(self._path(i, field), out[self.offsets[i]:self.offsets[i + 1]])
            return out
        # Offsets are mapped and checked per shard (small); the values are read, never touched through a map.
        parts = [self._open_column(i, field) for i in range(len(self.shards))]
        values = np.empty(sum(len(p.values) for p in parts), dtype=_values_dtype(spec))
        start = 0
        for i, part in enumerate(parts):
            self._read_into(self._path(i, f"{field}.values"), values[start:start + len(part.values)])
            start += len(part.values)
        return Ragged(values, ragged.join_offsets([p.offsets for p in parts]))

    @staticmethod
    def _read_into(path: str, part) -> None:
        """Fill ``part`` (a C-contiguous slice of the output) from the .npy file at ``path``, checking its header."""
        import numpy as np
        from numpy.lib import format as npy

        with open(path, "rb") as fh:
            try:
                version = npy.read_magic(fh)
                read_header = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}[version]
                got_shape, fortran, got_dtype = read_header(fh)
            except (ValueError, KeyError) as e:
                raise PreprocessError(f"shard file {path} is not a .npy file this reader knows: {e}") from e
            if got_shape != part.shape or got_dtype.name != part.dtype.name:
                raise PreprocessError(f"shard file {path} holds {got_dtype.name} {got_shape}, manifest says "
                                      f"{part.dtype.name} {part.shape}")
            if got_dtype != part.dtype or (fortran and part.ndim > 1):  # another byte order or layout: numpy converts
                part[...] = np.load(path, mmap_mode="r", allow_pickle=False)
                return
            view = memoryview(part.reshape(-1).view(np.uint8))
            done = 0
            while done < len(view):
                n = fh.readinto(view[done:])
                if not n:
                    raise PreprocessError(f"shard file {path} is truncated")
                done += n

    # -- reading ---------------------------------------------------------------------------------------

    def _indices(self, indices: Sequence[int]):
        import numpy as np

        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"indices out of range for {n} samples")
        return np.where(idx < 0, idx + n, idx)

    def gather(self, indices: Sequence[int]) -> list:
        """The samples ``indices`` of every chosen field, as numpy: an array per fixed field, a
        :class:`~dtrain.preprocess.ragged.Ragged` per variable one. One gather per shard and field."""
        import numpy as np

        idx = self._indices(indices)
        if self.cached:
            return [column[idx] if isinstance(column, np.ndarray) else
                    ragged.gather([(column, None, idx)], len(idx), column.values.dtype)
                    for column in map(self._whole, self.fields)]
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        order = np.argsort(shard_of, kind="stable")  # group by shard: one gather per shard touched
        sorted_shards = shard_of[order]
        cuts = np.flatnonzero(np.diff(sorted_shards)) + 1
        groups = [(int(sorted_shards[a]), order[a:b], idx[order[a:b]] - self.offsets[int(sorted_shards[a])])
                  for a, b in zip([0, *cuts], [*cuts, len(order)])]
        return [self._gather_field(field, len(idx), groups) for field in self.fields]

    def _gather_field(self, field: str, n: int, groups: list):
        import numpy as np

        spec = self.specs[field]
        if not spec.get("variable"):
            out = np.empty((n, *spec["shape"]), dtype=spec["dtype"])
            for shard, positions, rows in groups:
                out[positions] = self._column(shard, field)[rows]
            return out
        return ragged.gather([(self._column(shard, field), positions, rows) for shard, positions, rows in groups],
                             n, _values_dtype(spec))

    def to_torch(self, column, field: str, collate: str = "list", pad_value: PadValue = 0, pin: bool = False):
        """One gathered column as the batch's value: a tensor (fixed), a list of tensors or bytes, or Padded."""
        import torch

        if not isinstance(column, Ragged):
            tensor = torch.from_numpy(column)
            return tensor.pin_memory() if pin else tensor
        if collate == "pad":
            value = pad_value.get(field, 0) if isinstance(pad_value, Mapping) else pad_value
            try:
                values, mask = (torch.from_numpy(a) for a in ragged.pad(column, value))
            except OverflowError:
                raise ValueError(f"pad_value={value!r} does not fit field {field}'s dtype {self.specs[field]['dtype']}: "
                                 f"give a value it holds (pad_value may map field names to values)") from None
            return Padded(values.pin_memory(), mask.pin_memory()) if pin else Padded(values, mask)
        if self.specs[field]["dtype"] == BYTES:
            return [sample.tobytes() for sample in ragged.split(column)]
        data = torch.from_numpy(column.data())
        data = data.pin_memory() if pin else data
        return list(data.split(column.lengths.tolist()))  # views of one buffer: no copy per sample

    def __getitem__(self, index: int) -> tuple:
        columns = self.gather([index])
        return tuple(sample[0] for sample in
                     (self.to_torch(c, f) for c, f in zip(columns, self.fields)))

    def get_batch(self, indices: Sequence[int], collate: str = "list", pad_value: PadValue = 0) -> tuple:
        """A whole batch, one gather per shard and field: the cheapest way to read (no per-sample work).

        Fixed fields are tensors [batch, ...]; a variable-length field is a list (``collate="list"``:
        one 1-D tensor, or ``bytes``, per sample) or a :class:`Padded` (``collate="pad"``) filled with
        ``pad_value`` (one number, or a mapping of field name to number; 0 for a field it leaves out)."""
        check_collate(collate)
        return tuple(self.to_torch(c, f, collate, pad_value) for c, f in zip(self.gather(indices), self.fields))

    def __getitems__(self, indices: list[int]) -> list[tuple]:
        """DataLoader's batched fetch: gather the batch at once, then hand back per-sample items to collate."""
        batch = self.get_batch(indices)
        return list(zip(*(column if isinstance(column, list) else column.unbind(0) for column in batch)))


class ShardSampler:
    """Split sample indices by rank the way DistributedSampler does, without needing torch.distributed.

    Every epoch draws a permutation seeded by ``seed + epoch`` (identical on every rank) and
    deals it round-robin: rank r gets positions r, r + W, r + 2W, ... So within an epoch the
    ranks' sets are disjoint and every rank gets the same count (DDP never waits on a rank
    with a batch fewer). When the sample count N is not a multiple of W: ``drop_last=False``
    pads with the permutation's first samples (each sample at least once, a few twice);
    ``drop_last=True`` leaves out the permutation's last N mod W samples (different ones each
    epoch). With N a multiple of W every sample is seen exactly once per epoch either way.
    """

    def __init__(self, num_samples: int, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        num_replicas = int(os.environ.get("WORLD_SIZE", "1")) if num_replicas is None else num_replicas
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
        if num_samples < num_replicas:
            raise ValueError(f"{num_samples} samples cannot give each of {num_replicas} ranks one")
        self.num_samples_total = num_samples
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last:
            self.num_samples = num_samples // num_replicas
        else:
            self.num_samples = -(-num_samples // num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> list[int]:
        return self.indices_array().tolist()

    def indices_array(self):
        """This rank's indices for the current epoch as a numpy array (no per-index Python objects)."""
        import numpy as np

        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples_total)
        else:
            order = np.arange(self.num_samples_total)
        if self.total_size > len(order):
            order = np.concatenate([order, order[: self.total_size - len(order)]])
        return order[: self.total_size][self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        return self.num_samples


class ShardLoader:
    """Batches of a ShardDataset, read ``read_ahead`` batches at a time with one gather per field.

    ``read_ahead_bytes`` (default 512 KiB) bounds that block: with large samples (images) it holds
    fewer batches, at least one. 64 batches of 256 images of 12 KiB would be a 200 MB block,
    held twice while the next one is gathered, and slower to gather than one batch at a time.
    (A variable-length field counts with its mean sample size.)

    Iterating it once is one epoch in the sampler's current order (call ``sampler.set_epoch``
    before each). Yields tuples of batched tensors, like a DataLoader with the default collate,
    but with no per-sample work and no per-batch gather: a batch is a slice of the read-ahead
    block. No worker processes or threads: the read is a memory copy, cheaper than the hand-off. To
    read ahead off the training thread and copy to a GPU on a side stream, wrap it:
    ``DevicePrefetcher(loader, "cuda")`` (:mod:`dtrain.training.prefetch`).
    A variable-length field comes as a list per batch (``collate="list"``: views of the block, no
    copy) or as :class:`Padded` values and mask (``collate="pad"``, ``pad_value``), padded to the
    batch's longest sample.
    """

    def __init__(self, dataset: ShardDataset, batch_size: int, sampler: Any = None, drop_last: bool = True,
                 read_ahead: int = 64, pin_memory: bool = False, read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
                 collate: str = "list", pad_value: PadValue = 0):
        if batch_size < 1 or read_ahead < 1 or read_ahead_bytes < 1:
            raise ValueError(f"batch_size={batch_size}, read_ahead={read_ahead} and read_ahead_bytes="
                             f"{read_ahead_bytes} must be at least 1")
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.sampler = sampler if sampler is not None else ShardSampler(len(dataset))
        self.read_ahead, self.pin_memory, self.read_ahead_bytes = read_ahead, pin_memory, read_ahead_bytes
        self.collate, self.pad_value = check_collate(collate), pad_value

    def block_batches(self) -> int:
        """Batches gathered at once: ``read_ahead``, fewer when that would exceed ``read_ahead_bytes`` (at least 1)."""
        batch_bytes = self.batch_size * max(1, getattr(self.dataset, "sample_nbytes", 0))
        return max(1, min(self.read_ahead, self.read_ahead_bytes // batch_bytes))

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple]:
        for block in self.blocks():
            yield from block

    def blocks(self) -> Iterator[list[tuple]]:
        """The epoch's batches a gathered block at a time (what :class:`~dtrain.training.prefetch.DevicePrefetcher`
        reads on its thread and copies to the device in one go)."""
        import numpy as np

        order = self.sampler.indices_array() if hasattr(self.sampler, "indices_array") else np.fromiter(self.sampler, np.int64)
        indices = order[: len(self) * self.batch_size]
        block = self.batch_size * self.block_batches()
        for start in range(0, len(indices), block):
            columns = self.dataset.gather(indices[start:start + block])
            yield list(zip(*(self._batches(c, f) for c, f in zip(columns, self.dataset.fields))))

    def _batches(self, column, field: str) -> Iterator:
        """A gathered block's column as batches: a fixed field becomes one (pinned) tensor whose batches are
        views; a variable field is cut into windows (views), each collated on its own."""
        if not isinstance(column, Ragged):
            return iter(self.dataset.to_torch(column, field, pin=self.pin_memory).split(self.batch_size))
        return (self.dataset.to_torch(column.rows(a, min(a + self.batch_size, len(column))), field, self.collate,
                                      self.pad_value, self.pin_memory) for a in range(0, len(column), self.batch_size))
