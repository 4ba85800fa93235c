"""Materialising a model built on the ``meta`` device, stage by stage: storage on the
process's device, values from each module's reset (or the model's own initialisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from itertools import chain
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

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
    created = {id(tensor): _storage(tensor) for tensor in fresh.values()}
    with torch.no_grad(), _Writes() as writes:
        for reset in reversed(resets):
            reset()
    resetting = "init" if init is not None else "reset_parameters()"
    _refuse_unwritten(partition, created, writes.storages, resetting)
    return partition


def _refuse_unwritten(
    partition: nn.Module, created: dict[int, int], written: set[int], resets: str
) -> None:
    """Refuse new storage that no reset wrote into: it would hold whatever memory held.

    ``created``: each new tensor's storage; ``written``: the storages that
    ops wrote into during the resets (``_Writes``: in place, through a view
    or ``.data``). A slot given another tensor, or a tensor given other
    storage (``weight.data = ...``), was written too. (A tensor written in
    part is not seen: its rest keeps the value new storage starts with,
    NaN for floats, ``_mark``.)
    """
    named = chain(
        partition.named_parameters(remove_duplicate=True),
        partition.named_buffers(remove_duplicate=True),
    )
    unwritten = [
        name
        for name, t in named
        if id(t) in created
        and t.numel()
        and _storage(t) == created[id(t)]
        and _storage(t) not in written
    ]
    if unwritten:
        raise ValueError(
            f"{', '.join(unwritten)} got storage when materialised from the meta device, but "
            f"no {resets} wrote into it, so it would hold whatever that memory held: give it "
            "its values in DistributedPipe(init=...) (a function that initialises one module, "
            "buffers included: BatchNorm's running statistics, a counter, rotary tables, a "
            "mask), or build the model on a real device"
        )


class _Writes(TorchDispatchMode):
    """The storages that ops write into while it is on: the arguments their schemas mark
    as written (``normal_``, ``copy_``, ``out=``), whatever view or ``.data`` they go by."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for k, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = kwargs.get(argument.name, args[k] if k < len(args) else None)
                for tensor in value if isinstance(value, list | tuple) else (value,):
                    if isinstance(tensor, Tensor) and _has_storage(tensor):
                        self.storages.add(_storage(tensor))
        return func(*args, **kwargs)


def _has_storage(tensor: Tensor) -> bool:
    """A plain tensor's (a DTensor's ops reach this mode again on its local tensors; a sparse
    tensor has none of its own)."""
    return type(tensor) in (Tensor, nn.Parameter) and tensor.layout == torch.strided


def _storage(tensor: Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _mark(dtype: torch.dtype) -> float | int | bool:
    """What new storage of ``dtype`` starts as: NaN for floats, so that a part no reset
    wrote shows in the first loss; an integer's extreme value; False."""
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    if dtype == torch.bool:
        return False
    info = torch.iinfo(dtype)
    return info.max if info.min == 0 else info.min


def _storage_for(tensor: Tensor, device: torch.device) -> Tensor:
    new = torch.full_like(tensor, _mark(tensor.dtype), device=device)
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
