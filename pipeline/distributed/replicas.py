"""Checking that every rank holds the same model before any gradient is exchanged."""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist
from torch import nn


class TensorSignature(NamedTuple):
    """What must agree across ranks for one parameter or buffer."""

    kind: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool


def signature(module: nn.Module) -> list[TensorSignature]:
    """The module's parameters then buffers, as the ranks will compare them."""
    params = [
        TensorSignature("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in module.named_parameters()
    ]
    buffers = [
        TensorSignature("buffer", name, tuple(b.shape), str(b.dtype), False)
        for name, b in module.named_buffers()
    ]
    return params + buffers


def first_difference(
    reference: list[TensorSignature], other: list[TensorSignature], rank: int
) -> str | None:
    """Describe the first way `other` (rank `rank`) differs from rank 0's `reference`."""
    for mine, theirs in zip(reference, other, strict=False):
        if (mine.kind, mine.name) != (theirs.kind, theirs.name):
            return (
                f"{mine.kind} '{mine.name}' on rank 0 stands where rank {rank} has "
                f"{theirs.kind} '{theirs.name}'"
            )
        for field in ("shape", "dtype", "requires_grad"):
            if getattr(mine, field) != getattr(theirs, field):
                return (
                    f"{mine.kind} '{mine.name}' has {field} {getattr(mine, field)} on rank 0 "
                    f"but {getattr(theirs, field)} on rank {rank}"
                )
    if len(reference) != len(other):
        longer, owner = (reference, 0) if len(reference) > len(other) else (other, rank)
        extra = longer[min(len(reference), len(other))]
        return (
            f"rank 0 has {len(reference)} parameters and buffers but rank {rank} has "
            f"{len(other)}; the first extra one is {extra.kind} '{extra.name}' on rank {owner}"
        )
    return None


def check_replicas_match(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Raise ValueError on every rank if any rank's model differs from rank 0's.

    Every rank gathers every rank's signature, so all of them raise the same
    error instead of some of them waiting in a later collective.
    """
    gathered: list[list[TensorSignature]] = [[] for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather_object(gathered, signature(module), group=group)
    except RuntimeError as error:
        raise RuntimeError(
            "DataParallel: comparing parameter shapes across ranks (all_gather) failed or "
            f"timed out on rank {dist.get_rank(group)}: {error}"
        ) from error
    reference = gathered[0]
    for rank, other in enumerate(gathered[1:], start=1):
        difference = first_difference(reference, other, rank)
        if difference is not None:
            raise ValueError(
                f"DataParallel: the replicas differ: {difference}. Every rank must build "
                "the same model (same layers, shapes, dtypes and frozen parameters)."
            )
