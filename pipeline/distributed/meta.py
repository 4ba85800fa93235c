"""Materialising a model built on the ``meta`` device, stage by stage: storage on the
process's device, values from each module's reset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn

__all__ = ["materialized", "meta_resets"]


def materialized(partition: nn.Sequential, device: torch.device) -> nn.Sequential:
    """``partition`` on ``device``; layers on ``meta`` get storage and their initial values.

    Every module with tensors on ``meta`` (its own or its children's) is
    reset by its ``reset_parameters`` (or ``_reset_parameters``, as
    ``nn.MultiheadAttention`` names it), children before their parents, so
    that a parent's own initialisation of its children wins; layers not on
    ``meta`` keep their values. A module holding tensors on ``meta`` with
    neither method is refused: its values would be whatever the new storage
    held.
    """
    resets = meta_resets(partition)
    partition._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    with torch.no_grad():
        for reset in reversed(resets):
            reset()
    return partition


def meta_resets(module: nn.Module) -> list[Callable[[], None]]:
    """The resets that give ``module``'s tensors on ``meta`` values, parents first.

    Raises ``ValueError`` for a module holding tensors on ``meta`` without one.
    """
    resets = []
    for name, child in module.named_modules():
        reset = _reset_of(child)
        if reset is None and any(t.is_meta for t in _tensors(child, recurse=False)):
            raise ValueError(
                f"layer {name} ({type(child).__name__}) holds tensors on the meta device but "
                "has no reset_parameters() to give them values after materialisation: give it "
                "one, or build the model on a real device"
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
