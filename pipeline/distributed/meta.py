"""Materialising a model built on the ``meta`` device, stage by stage: storage on the
process's device, values from each module's reset (or the model's own initialisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from itertools import chain
from typing import cast

import torch
from torch import Tensor, nn

__all__ = ["Init", "materialized", "meta_resets"]

# Gives one module's own tensors their initial values (transformers: model._init_weights).
Init = Callable[[nn.Module], None]


def materialized(
    partition: nn.Sequential,
    device: torch.device,
    init: Init | None = None,
    model: nn.Module | None = None,
) -> nn.Sequential:
    """``partition`` on ``device``; tensors on ``meta`` get storage and their initial values.

    Every module with tensors on ``meta`` (its own or its children's) is
    reset by ``init(module)`` if given, else by its ``reset_parameters`` (or
    ``_reset_parameters``, as ``nn.MultiheadAttention`` names it), children
    before their parents, so that a parent's own initialisation of its
    children wins; tensors not on ``meta`` keep their values. A module
    holding tensors on ``meta`` with no reset is refused: its values would be
    whatever the new storage held.

    Each tensor on ``meta`` becomes one new tensor, put in every slot that
    held it, in the partition and in ``model`` (the whole model it is part
    of): a weight tied to another module (GPT-2's head and token embedding)
    stays one parameter wherever the model holds it, and the modules a split
    model's pieces read it from see it.
    """
    resets = meta_resets(partition, init)
    meta = [t for t in chain(partition.parameters(), partition.buffers()) if t.is_meta]
    fresh = {id(t): _storage_for(t, device) for t in meta}
    holders = [*partition.modules(), *([] if model is None else model.modules())]
    for holder in holders:
        for name, parameter in holder._parameters.items():
            if parameter is not None and id(parameter) in fresh:
                holder._parameters[name] = cast(nn.Parameter, fresh[id(parameter)])
        for name, buffer in holder._buffers.items():
            if buffer is not None and id(buffer) in fresh:
                holder._buffers[name] = fresh[id(buffer)]
    partition._apply(lambda t: t.to(device))
    versions = {id(tensor): tensor._version for tensor in fresh.values()}
    with torch.no_grad():
        for reset in reversed(resets):
            reset()
    _refuse_unwritten(partition, versions, "init" if init is not None else "reset_parameters()")
    return partition


def _refuse_unwritten(partition: nn.Module, versions: dict[int, int], resets: str) -> None:
    """Refuse new storage that no reset wrote into: it would hold whatever memory held.

    New storage starts marked (``_mark``): a float tensor with NaN, an
    integer one with its type's least (unsigned: greatest) value. A float
    tensor keeping a NaN was not written there; an integer one is unwritten
    where every value keeps the mark and its version has not moved (a reset
    may write zeros, or through ``.data``, which counts no version). A slot
    given another tensor was written.
    """
    named = chain(
        partition.named_parameters(remove_duplicate=True),
        partition.named_buffers(remove_duplicate=True),
    )
    unwritten = [name for name, t in named if id(t) in versions and _unwritten(t, versions[id(t)])]
    if unwritten:
        raise ValueError(
            f"{', '.join(unwritten)} got storage when materialised from the meta device, but "
            f"no {resets} wrote into all of it, so it would hold whatever that memory held: "
            "give it its values in DistributedPipe(init=...) (a function that initialises one "
            "module, buffers included: BatchNorm's running statistics, a counter, rotary "
            "tables), or build the model on a real device"
        )


def _mark(dtype: torch.dtype) -> float | int | None:
    """What new storage of ``dtype`` starts as (``_refuse_unwritten``); None for bool."""
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    if dtype == torch.bool:
        return None
    info = torch.iinfo(dtype)
    return info.max if info.min == 0 else info.min


def _unwritten(tensor: Tensor, version: int) -> bool:
    mark = _mark(tensor.dtype)
    if mark is None or tensor.numel() == 0:
        return False  # a bool starts False: nothing of the old memory is left
    with torch.no_grad():
        if isinstance(mark, float):
            return bool(tensor.isnan().any())
        return tensor._version == version and bool((tensor == mark).all())


def _storage_for(tensor: Tensor, device: torch.device) -> Tensor:
    mark = _mark(tensor.dtype)
    new = torch.full_like(tensor, False if mark is None else mark, device=device)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(new, requires_grad=tensor.requires_grad)
    return new


def meta_resets(module: nn.Module, init: Init | None = None) -> list[Callable[[], None]]:
    """The resets that give ``module``'s tensors on ``meta`` values, parents first.

    Raises ``ValueError`` for a module holding tensors on ``meta`` without one.
    """
    resets = []
    for name, child in module.named_modules():
        reset = _reset_of(child) if init is None else partial(init, child)
        if reset is None and any(t.is_meta for t in _tensors(child, recurse=False)):
            raise ValueError(
                f"layer {name} ({type(child).__name__}) holds tensors on the meta device but "
                "has no reset_parameters() to give them values after materialisation: give it "
                "one, pass DistributedPipe(init=...) (a function that initialises one module: "
                "model._init_weights for a transformers model), or build the model on a real "
                "device"
            )
        if reset is not None and any(t.is_meta for t in _tensors(child, recurse=True)):
            resets.append(reset)
    return resets


def _tensors(module: nn.Module, recurse: bool) -> list[Tensor]:
    return [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]


def _reset_of(module: nn.Module) -> Callable[[], None] | None:
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            return cast(Callable[[], None], reset)
    return None
