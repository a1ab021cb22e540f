"""Host copies of a state dict's tensors, kept between checkpoint saves: the staging area of a save.

A save copies every tensor of the state into a host buffer of its own (allocated on the first save,
reused by every later one while the tensor keeps its path, shape and dtype), then writes the host copy;
training may change the originals as soon as the copy is done. On CUDA the buffers are pinned (page-locked
by torch's pinned host allocator: a device-to-host copy into them runs at the bus's speed, a pageable
copy at a fraction of it), every copy is issued non-blocking, and one synchronize ends the stage.

Why our own and not torch's ``DefaultStager``: from torch 2.11 its ``_stage`` closes the
``StateDictStager`` it keeps (which empties its type dispatch table), so a stager kept across saves
fails on the second one with ``KeyError: <class 'type'>``; a new stager per save pins its memory anew
each time. This pool works the same on every torch this package supports.

The same buffers serve a load: :meth:`HostBuffers.mirror` gives the host copy of a state for DCP to
read into, and :meth:`HostBuffers.restore` copies it back onto the devices.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

#: values DCP stores as they are (no copy needed: immutable)
_PLAIN = (int, float, bool, str, bytes, type(None))


def _dtensor_type():
    """torch's DTensor class, or None where torch.distributed has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without the public DTensor module
        return None
    return DTensor


class HostBuffers:
    """Host buffers for the tensors of one state dict, keyed by where each tensor sits in it
    (``("model", "layer.weight")``), its shape and dtype. One stage at a time (a checkpointer waits
    for its previous save before the next: the buffers of a save in flight are not overwritten).

    An asynchronous save reaches it through the storage writer's ``stage``
    (:class:`dtrain.training.dcp_io.HostStaged`).
    """

    def __init__(self):
        self._buffers: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes held in host buffers."""
        return sum(getattr(b, "_local_tensor", b).untyped_storage().nbytes() for b in self._buffers.values())

    # -- save: device -> host ----------------------------------------------------------------------

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors are host buffers holding the values they have now."""
        import torch

        with self._lock, torch.no_grad():
            used: set[tuple] = set()
            staged = self._walk(state, (), used, copy_in=True)
            self._drop_unused(used)
            _synchronize_devices(state)
            return staged

    def close(self) -> None:
        with self._lock:
            self._buffers.clear()

    # -- load: host -> device ----------------------------------------------------------------------

    def mirror(self, state: Any) -> Any:
        """A copy of ``state`` with every tensor replaced by its host buffer (values not copied):
        what a DCP load reads into before :meth:`restore` copies it onto the devices."""
        import torch

        with self._lock, torch.no_grad():
            used: set[tuple] = set()
            mirrored = self._walk(state, (), used, copy_in=False)
            self._drop_unused(used)
            return mirrored

    def restore(self, state: Any, mirrored: Any) -> Any:
        """Copy the loaded host ``mirrored`` into ``state``'s tensors in place; returns ``state`` with
        its non-tensor values taken from ``mirrored`` (a load replaces those)."""
        import torch

        with torch.no_grad():
            restored = _restore(state, mirrored)
            _synchronize_devices(state)
            return restored

    # -- the walk ----------------------------------------------------------------------------------

    def _walk(self, value: Any, path: tuple, used: set, copy_in: bool) -> Any:
        import torch

        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, used, copy_in)
        if isinstance(value, dict):
            return {k: self._walk(v, (*path, k), used, copy_in) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._walk(v, (*path, i), used, copy_in) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, _PLAIN):
            return value
        return copy.deepcopy(value)  # anything else DCP pickles: frozen as it is now

    def _tensor(self, tensor, path: tuple, used: set, copy_in: bool):
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(tensor, dtensor):
            local = tensor._local_tensor
            key = (path, "dtensor", tuple(tensor.shape), tuple(local.shape), local.dtype, str(tensor.placements))
            host = self._buffers.get(key)
            if host is None:
                # the same spec (mesh, placements, global shape) over a host local tensor of our own
                detached = tensor.detach()
                host = detached.to("cpu") if local.device.type != "cpu" else copy.deepcopy(detached)
                host._local_tensor = self._allocate(local)
                self._buffers[key] = host
            if copy_in:
                host._local_tensor.copy_(local.detach(), non_blocking=_non_blocking(local))
        else:
            key = (path, "tensor", tuple(tensor.shape), tensor.dtype)
            host = self._buffers.get(key)
            if host is None:
                host = self._buffers[key] = self._allocate(tensor)
            if copy_in:
                host.copy_(tensor.detach(), non_blocking=_non_blocking(tensor))
        used.add(key)
        return host

    @staticmethod
    def _allocate(tensor):
        import torch

        # torch's pinned host allocator: page-locked blocks, each its own storage (DCP writes a tensor
        # whose storage is larger than it through one more copy), rounded up to a power of two
        return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="cpu",
                           pin_memory=tensor.device.type == "cuda")

    def _drop_unused(self, used: set) -> None:
        """Free buffers no tensor of this state needs (a shape or dtype changed, a key went away)."""
        for key in [k for k in self._buffers if k not in used]:
            del self._buffers[key]


def _non_blocking(tensor) -> bool:
    return tensor.device.type == "cuda"


def cuda_devices(state: Any, found: set | None = None) -> set:
    """The CUDA devices ``state``'s tensors are on."""
    import torch

    found = set() if found is None else found
    if isinstance(state, torch.Tensor):
        if state.device.type == "cuda":
            found.add(state.device)
    elif isinstance(state, dict):
        for v in state.values():
            cuda_devices(v, found)
    elif isinstance(state, (list, tuple)):
        for v in state:
            cuda_devices(v, found)
    return found


def _synchronize_devices(state: Any) -> None:
    """Wait for the non-blocking copies issued for ``state``'s CUDA tensors (one sync per device)."""
    import torch

    for device in cuda_devices(state):
        torch.cuda.synchronize(device)


def _restore(state: Any, loaded: Any) -> Any:
    import torch

    if isinstance(state, torch.Tensor):
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(state, dtensor):
            state._local_tensor.copy_(loaded._local_tensor, non_blocking=_non_blocking(state._local_tensor))
        else:
            state.copy_(loaded, non_blocking=_non_blocking(state))
        return state
    if isinstance(state, dict):  # in place, as a DCP load fills a state dict
        for key in state:
            state[key] = _restore(state[key], loaded[key])
        return state
    if isinstance(state, list) and isinstance(loaded, list) and len(loaded) == len(state):
        state[:] = [_restore(v, w) for v, w in zip(state, loaded)]
        return state
    if isinstance(state, tuple) and isinstance(loaded, (list, tuple)) and len(loaded) == len(state):
        return tuple(_restore(v, w) for v, w in zip(state, loaded))
    return loaded
