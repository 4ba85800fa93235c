"""Activation memory of a stage: the bytes autograd saved for its backward, at their peak.

Measured only when a step asks (``measure_memory=True``): a stage's forward
(and the recomputation inside its backward) runs under saved-tensor hooks
that count each storage a saved tensor uses, once however many tensors view
it, until autograd lets the last of them go (the backward ran, or the graph
was dropped)::

    F 0   saves a, b    live {a, b}        peak a + b
    F 1   saves c       live {a, b, c}     peak a + b + c
    B 0   frees a, b    live {c}

Parameters are not activations and are left out (FSDP2's gathered ones
too, and views of them), and so are the caller's input and target, of
which the micro-batches are views (the step keeps no copy of them): what
is counted is what the step itself keeps. A DTensor counts its shard, a
sparse tensor its indices and values. torch does not check a tensor saved
under hooks for writes in place before its backward; the meter does,
raising torch's error where torch would. The count is the same on CPU and
CUDA: bytes autograd holds, not what the allocator reserved (its caches,
its rounding, the workspace of kernels); a view counts its whole storage.
It costs a few microseconds per saved tensor, so it is off by
default.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.runtime.lazy import instance_of

__all__ = ["ActivationMeter"]


class ActivationMeter:
    """Counts the storages saved for backward under ``hooks()``, and their peak in bytes."""

    def __init__(self, excluded: Iterable[Tensor]) -> None:
        """``excluded``: tensors whose storages are not counted (parameters, the caller's batch)."""
        self._excluded = {key for t in excluded if (key := _storage_key(t)) is not None}
        # Storage address -> [bytes, saved tensors still holding it].
        self._live: dict[int, list[int]] = {}
        # Released from whichever thread drops the graph.
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def hooks(self) -> AbstractContextManager[None]:
        """Within the block, on this thread, tensors saved for backward are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: Tensor) -> Any:
        keys = [] if _is_parameter(tensor) else _storages(tensor)
        keys = [(key, size) for key, size in keys if key not in self._excluded]
        if not keys:
            return _Saved(tensor)  # checked, not counted
        with self._lock:
            for key, size in keys:
                entry = self._live.setdefault(key, [size, 0])
                if entry[1] == 0:
                    self.current += entry[0]
                    self.peak = max(self.peak, self.current)
                entry[1] += 1
        # Detached: a tensor an op saves as its own output has that op's node as
        # its grad_fn, and node -> packed -> tensor -> node is a cycle that only a
        # backward freeing the graph breaks (zb-h1's W keeps it: it never would).
        saved = _Saved(tensor.detach())
        weakref.finalize(saved, self._release, [key for key, _ in keys])
        return saved

    def _release(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                entry = self._live[key]
                entry[1] -= 1
                if entry[1] == 0:
                    self.current -= entry[0]
                    del self._live[key]


class _Saved:
    """A saved tensor with its version when saved; a counted one's collection tells the meter
    autograd let it go.

    torch checks that a saved tensor was not modified in place before its backward only
    for tensors saved without hooks; under the meter's, ``_unpack`` checks in its stead.
    """

    __slots__ = ("__weakref__", "tensor", "version")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version


def _storage_key(tensor: Tensor) -> int | None:
    """The address of ``tensor``'s storage (a DTensor's: its shard's); None where it has
    none to give (an FSDP2 parameter's unsharded storage, freed at its reshard)."""
    found = _storages(tensor)
    return found[0][0] if found else None


def _storages(tensor: Tensor) -> list[tuple[int, int]]:
    """The storages holding ``tensor``'s data, as (address, bytes): a DTensor's shard's, a
    sparse tensor's indices' and values'; none where it has none to give (an FSDP2
    parameter's unsharded storage, freed at its reshard)."""
    if instance_of(tensor, "torch.distributed.tensor", "DTensor"):
        tensor = tensor.to_local()  # type: ignore[attr-defined]
    if tensor.layout == torch.sparse_coo:
        parts = [tensor._indices(), tensor._values()]
    elif tensor.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        compressed = tensor.layout in (torch.sparse_csr, torch.sparse_bsr)
        indices = (
            (tensor.crow_indices(), tensor.col_indices())
            if compressed
            else (tensor.ccol_indices(), tensor.row_indices())
        )
        parts = [*indices, tensor.values()]
    else:
        parts = [tensor]
    try:
        return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in parts]
    except (RuntimeError, NotImplementedError):
        return []


def _is_parameter(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a parameter or a view of one: FSDP2 gathers a unit's parameters
    into storages of their own during the step, after the meter was made."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _unpack(saved: _Saved) -> Tensor:
    tensor = saved.tensor
    if tensor._version != saved.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
            f"{tensor._version}; expected version {saved.version} instead (checked by "
            "measure_memory=True's meter, as torch checks a step that does not measure)"
        )
    return tensor
