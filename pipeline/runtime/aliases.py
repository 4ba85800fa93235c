"""Tensors of a partition's output that share memory, written into by the next partition.

A layer may return one tensor twice, or a view beside its base
(``return h, h[:, :2]``). In the plain model a later layer writing into one
of them in place changes the other too. Between partitions each tensor
travels on its own (a copy to another device or process, a leaf of the
next stage's graph, a copy for a first layer that writes into its input),
so the write would change only one, and the outputs and gradients after it
would differ, silently::

    partition j      returns (h, h)                 one memory
    partition j + 1  receives (a, b)                two, once sent
                     a.add_(1)                      b unchanged: the plain model's b is a

So the positions of such tensors in a partition's output are noted
(``sharing_positions``), and a write into them by the next partition is
refused (``refuse_written``): at once where its first layer declares that
it writes into its input (``inplace``), else after its forward, by their
version counters.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from pipeline.runtime.microbatch import Value

__all__ = ["raise_shared_written", "refuse_written", "sharing_positions", "versions_at"]


def sharing_positions(value: Value) -> frozenset[int]:
    """The positions, among ``value``'s leaves, of the tensors that share memory with another.

    >>> h = torch.zeros(4, 4)
    >>> sorted(sharing_positions((h, torch.ones(2), h[:, :2])))
    [0, 2]
    """
    leaves = tree_leaves(value)
    if sum(isinstance(leaf, Tensor) for leaf in leaves) < 2:
        return frozenset()
    by_memory: dict[int, list[int]] = {}
    for k, leaf in enumerate(leaves):
        if _has_memory(leaf):
            by_memory.setdefault(leaf.untyped_storage().data_ptr(), []).append(k)
    return frozenset(k for found in by_memory.values() if len(found) > 1 for k in found)


def _has_memory(leaf: object) -> bool:
    """A dense tensor with memory of its own to share (not meta, not empty, not sparse)."""
    return (
        isinstance(leaf, Tensor)
        and leaf.layout == torch.strided
        and not leaf.is_nested
        and leaf.device.type != "meta"
        and leaf.numel() > 0
    )


def versions_at(value: Value, positions: frozenset[int]) -> list[tuple[int, Tensor, int]]:
    """The tensors of ``value`` at ``positions`` (its leaves'), with their version counters."""
    leaves = tree_leaves(value)
    return [
        (k, leaves[k], leaves[k]._version)
        for k in sorted(positions)
        if k < len(leaves) and isinstance(leaves[k], Tensor)
    ]


def refuse_written(j: int, noted: list[tuple[int, Tensor, int]]) -> None:
    """Refuse partition ``j``'s write into its input where partition ``j - 1`` returned
    tensors sharing memory (``noted``: each with its version before ``j``'s forward)."""
    written = [k for k, tensor, version in noted if tensor._version != version]
    if written:
        raise_shared_written(j, f"wrote in place into its input's leaf {written[0]}")


def raise_shared_written(j: int, what: str) -> None:
    """Raise the refusal of partition ``j``, which ``what``."""
    raise RuntimeError(
        f"partition {j} {what}, which partition {j - 1} returned as tensors sharing memory "
        "(one tensor twice, or a view beside its base): in the plain model the write shows "
        "in each of them, but between partitions each travels on its own, so it would show "
        "in one; return a copy (h.clone()) for all but one of them, or keep the writing "
        "layer in the partition that returns them"
    )
