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
"""

from __future__ import annotations

import bisect
import hashlib
import math
import os
from typing import Any, Iterator, Sequence

from dtrain.preprocess.errors import PreprocessError
from dtrain.preprocess.shardfmt import file_sha256, load_manifest


DEFAULT_CACHE_BYTES = 32 << 20
DEFAULT_READ_AHEAD_BYTES = 512 << 10


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
    """

    def __init__(self, directory: str, fields: Sequence[str] = ("x", "y"), verify: bool = False,
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.directory = os.path.abspath(directory)
        self.manifest = load_manifest(self.directory)
        missing = [f for f in fields if f not in self.manifest["fields"]]
        if missing:
            raise PreprocessError(f"{self.directory}: fields {missing} are not in the dataset; it has "
                                  f"{sorted(self.manifest['fields'])}")
        self.fields = tuple(fields)
        self.shards = self.manifest["shards"]
        self.offsets = [0]
        for shard in self.shards:
            self.offsets.append(self.offsets[-1] + shard["num_samples"])
        if self.offsets[-1] != self.manifest["num_samples"]:
            raise PreprocessError(f"{self.directory}: shards hold {self.offsets[-1]} samples, manifest says "
                                  f"{self.manifest['num_samples']}")
        self._check_files(verify)
        import numpy as np

        self._starts = np.asarray(self.offsets[:-1], dtype=np.int64)
        self._maps: dict[tuple[int, str], Any] = {}
        self._pid = os.getpid()
        self.nbytes = sum(shard["files"][f]["bytes"] for shard in self.shards for f in self.fields)
        specs = [self.manifest["fields"][f] for f in self.fields]
        self.sample_nbytes = sum(np.dtype(s["dtype"]).itemsize * math.prod(s["shape"]) for s in specs)
        self.cached = self.nbytes <= cache_bytes
        self._cache: dict[str, Any] = {}

    def _check_files(self, verify: bool) -> None:
        for shard in self.shards:
            for field in self.fields:
                info = shard["files"][field]
                path = os.path.join(self.directory, info["path"])
                try:
                    size = os.path.getsize(path)
                except OSError as e:
                    raise PreprocessError(f"shard file {path} is missing: {e}") from e
                if size != info["bytes"]:
                    raise PreprocessError(f"shard file {path} has {size} bytes, manifest says {info['bytes']}")
                if verify and file_sha256(path) != info["sha256"]:
                    raise PreprocessError(f"shard file {path} does not match its SHA-256 in the manifest")
            if verify:
                digest = hashlib.sha256()
                for field in sorted(shard["files"]):
                    digest.update(f"{field}:{shard['files'][field]['sha256']}\n".encode())
                if digest.hexdigest() != shard["sha256"]:
                    raise PreprocessError(f"shard {shard['path']}: checksum of its files does not match the manifest")

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"], state["_cache"] = {}, {}  # each process maps (or caches) the files itself
        return state

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked DataLoader worker: do not share the parent's maps
            self._maps, self._cache, self._pid = {}, {}, os.getpid()

    def _whole(self, field: str):
        """The field of every sample as one array (cached mode)."""
        self._check_pid()
        array = self._cache.get(field)
        if array is None:
            array = self._cache[field] = self._read_whole(field)
        return array

    def _read_whole(self, field: str):
        """Read every shard's file of ``field`` straight into one array: one copy of the data, and no
        memory map whose pages would sit in this process's memory next to it while it is filled."""
        import numpy as np
        from numpy.lib import format as npy

        spec = self.manifest["fields"][field]
        dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
        out = np.empty((len(self), *shape), dtype=dtype)
        for i, shard in enumerate(self.shards):
            path = os.path.join(self.directory, shard["files"][field]["path"])
            part = out[self.offsets[i]:self.offsets[i + 1]]  # a C-contiguous slice of the output
            with open(path, "rb") as fh:
                try:
                    version = npy.read_magic(fh)
                    read_header = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}[version]
                    got_shape, fortran, got_dtype = read_header(fh)
                except (ValueError, KeyError) as e:
                    raise PreprocessError(f"shard file {path} is not a .npy file this reader knows: {e}") from e
                if got_shape != part.shape or got_dtype.name != dtype.name:
                    raise PreprocessError(f"shard file {path} holds {got_dtype.name} {got_shape}, manifest says "
                                          f"{dtype.name} {part.shape}")
                if got_dtype != dtype or (fortran and part.ndim > 1):  # another byte order or layout: numpy converts
                    part[...] = np.load(path, mmap_mode="r", allow_pickle=False)
                    continue
                view = memoryview(part.reshape(-1).view(np.uint8))
                done = 0
                while done < len(view):
                    n = fh.readinto(view[done:])
                    if not n:
                        raise PreprocessError(f"shard file {path} is truncated")
                    done += n
        return out

    def _array(self, shard: int, field: str):
        self._check_pid()
        key = (shard, field)
        array = self._maps.get(key)
        if array is None:
            import numpy as np

            path = os.path.join(self.directory, self.shards[shard]["files"][field]["path"])
            # A plain ndarray view of the map: np.memmap's own indexing hooks cost more than the gather.
            array = np.load(path, mmap_mode="r", allow_pickle=False).view(np.ndarray)
            spec = self.manifest["fields"][field]
            want = (self.shards[shard]["num_samples"], *spec["shape"])
            if array.shape != want or array.dtype.name != spec["dtype"]:
                raise PreprocessError(f"shard file {path} holds {array.dtype} {array.shape}, manifest says "
                                      f"{spec['dtype']} {want}")
            self._maps[key] = array
        return array

    def _locate(self, index: int) -> tuple[int, int]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        shard = bisect.bisect_right(self.offsets, index) - 1
        return shard, index - self.offsets[shard]

    def __getitem__(self, index: int) -> tuple:
        import numpy as np
        import torch

        if self.cached:
            index = int(index)
            if not -len(self) <= index < len(self):
                raise IndexError(f"index {index} out of range for {len(self)} samples")
            return tuple(torch.from_numpy(np.array(self._whole(f)[index])) for f in self.fields)
        shard, row = self._locate(int(index))
        return tuple(torch.from_numpy(np.array(self._array(shard, f)[row])) for f in self.fields)

    def get_batch(self, indices: Sequence[int]) -> tuple:
        """A whole batch, one gather per shard and field: the cheapest way to read (no per-sample work)."""
        import numpy as np
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"indices out of range for {n} samples")
        idx = np.where(idx < 0, idx + n, idx)
        if self.cached:
            return tuple(torch.from_numpy(self._whole(field)[idx]) for field in self.fields)
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        order = np.argsort(shard_of, kind="stable")  # group by shard: one gather per shard touched
        sorted_shards = shard_of[order]
        cuts = np.flatnonzero(np.diff(sorted_shards)) + 1
        groups = [(int(sorted_shards[a]), order[a:b]) for a, b in zip([0, *cuts], [*cuts, len(order)])]
        outputs = []
        for field in self.fields:
            spec = self.manifest["fields"][field]
            out = np.empty((len(idx), *spec["shape"]), dtype=spec["dtype"])
            for shard, positions in groups:
                out[positions] = self._array(shard, field)[idx[positions] - self.offsets[shard]]
            outputs.append(torch.from_numpy(out))
        return tuple(outputs)

    def __getitems__(self, indices: list[int]) -> list[tuple]:
        """DataLoader's batched fetch: gather the batch at once, then hand back per-sample items to collate."""
        batch = self.get_batch(indices)
        return list(zip(*(t.unbind(0) for t in batch)))


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

    Iterating it once is one epoch in the sampler's current order (call ``sampler.set_epoch``
    before each). Yields tuples of batched tensors, like a DataLoader with the default collate,
    but with no per-sample work and no per-batch gather: a batch is a slice of the read-ahead
    block. No worker processes or threads: the read is a memory copy, cheaper than the hand-off.
    """

    def __init__(self, dataset: ShardDataset, batch_size: int, sampler: Any = None, drop_last: bool = True,
                 read_ahead: int = 64, pin_memory: bool = False, read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES):
        if batch_size < 1 or read_ahead < 1 or read_ahead_bytes < 1:
            raise ValueError(f"batch_size={batch_size}, read_ahead={read_ahead} and read_ahead_bytes="
                             f"{read_ahead_bytes} must be at least 1")
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.sampler = sampler if sampler is not None else ShardSampler(len(dataset))
        self.read_ahead, self.pin_memory, self.read_ahead_bytes = read_ahead, pin_memory, read_ahead_bytes

    def block_batches(self) -> int:
        """Batches gathered at once: ``read_ahead``, fewer when that would exceed ``read_ahead_bytes`` (at least 1)."""
        batch_bytes = self.batch_size * max(1, getattr(self.dataset, "sample_nbytes", 0))
        return max(1, min(self.read_ahead, self.read_ahead_bytes // batch_bytes))

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple]:
        import numpy as np

        order = self.sampler.indices_array() if hasattr(self.sampler, "indices_array") else np.fromiter(self.sampler, np.int64)
        indices = order[: len(self) * self.batch_size]
        block = self.batch_size * self.block_batches()
        for start in range(0, len(indices), block):
            arrays = self.dataset.get_batch(indices[start:start + block])
            if self.pin_memory:
                arrays = tuple(t.pin_memory() for t in arrays)
            yield from zip(*(t.split(self.batch_size) for t in arrays))
