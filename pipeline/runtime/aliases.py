"""Tensors of a partition's output that share memory, written into by the next partition.

A layer may return one tensor twice, or a view beside its base
(``return h, h[:, :2]``). In the plain model a later layer writing into one
of them in place changes the other too. Between partitions a tensor may
travel on its own (a copy to another device or process, a leaf of the next
stage's graph, a copy for a first layer that writes into its input), so the
write would change only one, and the outputs and gradients after it would
differ, silently::

    partition j      returns (h, h)                 one memory
    partition j + 1  receives (a, b)                two, once sent
                     a.add_(1)                      b unchanged: the plain model's b is a

So the groups of tensors in a partition's output whose memory overlaps are
noted (``sharing_groups``), and a write into one of them by the next
partition is refused (``refuse_written``) where the tensors it received no
longer overlap, or need a gradient: at once where its first layer declares
that it writes into its input (``inplace``: it gets a copy of each), else
after its forward, by their version counters. Tensors that need no gradient,
received as they were sent (one process, one device), still overlap, and
pass. A DistributedPipe's stage tells the groups in its message to the next
process, which receives the tensors apart (``Message.sharing``).

A skip that leaves its partition is such a tensor too, when it shares
memory with what the partition returns (``yield stash("s", h); return h``)
or with another skip: the skip travels apart from the main path, so a later
write into one would not show in the other::

    partition j      stashes h as "s", returns h     one memory
    partition j + 1  receives a, a.add_(1)           the pop of "s" gets h unwritten
    partition t      pops "s", s.mul_(3)             the main path does not see it

So where messages travel apart (between devices or processes), such a leaf
is noted as a group of one (``skip_aliases``), and a write into it by the
next partition is refused as a write into a group is; a leaf returned
unchanged, or a skip stashed, from a noted input leaf or a popped shared
skip is noted in turn; a skip's message says it shares memory (a group of
one), and a write into it by the partition that pops it is refused
(``skip/tracker.py``). Where every partition is on one device in one
process, the paths stay one memory and a write shows on both, as in the
plain model: nothing is noted. The refusal goes by version counters: a
write into the part of the tensor a skip does not view is refused too,
between devices or processes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from pipeline.runtime.microbatch import Value

__all__ = [
    "SKIP_APART",
    "Noted",
    "noted_leaves",
    "raise_shared_written",
    "refuse_written",
    "sharing_groups",
    "skip_aliases",
    "versions_at",
]

# A group's received tensors, each with its position among the leaves and its version.
Noted = list[list[tuple[int, Tensor, int]]]


def sharing_groups(value: Value) -> list[frozenset[int]]:
    """The positions, among ``value``'s leaves, of tensors whose memory overlaps another's,
    in groups that overlap.

    >>> h = torch.zeros(4, 4)
    >>> sharing_groups((h, torch.ones(2), h[:, :2], h[:, 2:3]))
    [frozenset({0, 2, 3})]
    >>> sharing_groups((h[:, :2], h[:, 2:]))  # no element in common: a write is one's alone
    []
    """
    leaves = tree_leaves(value)
    if sum(isinstance(leaf, Tensor) for leaf in leaves) < 2:
        return []
    groups: list[set[int]] = []
    for k, leaf in enumerate(leaves):
        if _has_memory(leaf):
            joined = [g for g in groups if any(_meet(leaf, leaves[q]) for q in g)]
            merged = {k}.union(*joined)
            groups = [g for g in groups if g not in joined] + [merged]
    return [frozenset(g) for g in groups if len(g) > 1]


def skip_aliases(
    returned: list[Any], skips: list[Tensor], shared: Sequence[Tensor] = ()
) -> tuple[list[int], list[int]]:
    """Which of a partition's ``returned`` leaves share memory with one of the ``skips``
    leaving it, or with one of the ``shared`` tensors (its input leaves noted as sharing
    memory with a skip, the skips it popped that share memory with another path); and which
    of those skips share memory with a returned leaf, another skip or a ``shared`` tensor.

    >>> h = torch.zeros(4, 4)
    >>> skip_aliases([h[:2], torch.ones(2)], [h, torch.ones(3)])
    ([0], [0])
    >>> skip_aliases([torch.ones(2)], [h[:, :2], h[:, 1]])  # two skips, one memory
    ([], [0, 1])
    >>> skip_aliases([h], [], shared=[h[1]])  # passed on unchanged
    ([0], [])
    """
    kept = [s if _has_memory(s) else None for s in skips]
    leaves = [r if _has_memory(r) else None for r in returned]
    held = [t for t in shared if _has_memory(t)]
    if not (held or any(k is not None for k in kept)):
        return [], []
    others = [*kept, *held]
    shown = [k for k, r in enumerate(leaves) if any(_meets(r, o) for o in others)]
    aliased = [
        q
        for q, s in enumerate(kept)
        if any(_meets(s, r) for r in leaves)
        or any(_meets(s, o) for p, o in enumerate(others) if p != q)
    ]
    return shown, aliased


def noted_leaves(value: Value, groups: list[frozenset[int]]) -> list[Tensor]:
    """``value``'s leaves noted as sharing memory with a skip (groups of one)."""
    leaves = tree_leaves(value)
    found = [leaves[k] for g in groups if len(g) == 1 for k in g if k < len(leaves)]
    return [t for t in found if isinstance(t, Tensor)]


def _meets(a: Tensor | None, b: Tensor | None) -> bool:
    return a is not None and b is not None and _meet(a, b)


def _has_memory(leaf: object) -> bool:
    """A dense tensor with memory of its own to share (not meta, not empty, not sparse; not
    a wrapper with no storage, such as the result of a collective not waited for yet)."""
    if not (
        isinstance(leaf, Tensor)
        and leaf.layout == torch.strided
        and not leaf.is_nested
        and leaf.device.type != "meta"
        and leaf.numel() > 0
    ):
        return False
    try:
        leaf.untyped_storage().data_ptr()
    except RuntimeError:
        return False
    return True


def _span(tensor: Tensor) -> tuple[int, int, int]:
    """The bytes ``tensor`` reaches in its storage: (storage, first, last + 1)."""
    size = tensor.element_size()
    first = int(tensor.storage_offset()) * size
    reach = sum((int(n) - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.untyped_storage().data_ptr(), first, first + (reach + 1) * size


def _overlap(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _meet(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` hold an element of one memory in common (column slices of
    one matrix interleave in it, and hold none)."""
    if not _overlap(_span(a), _span(b)):
        return False
    if a.element_size() != b.element_size():
        return True  # a view of another dtype: taken to meet wherever it reaches
    return _elements_meet(_layout(a), _layout(b))


Layout = tuple[tuple[int, ...], tuple[int, ...], int]


def _layout(tensor: Tensor) -> Layout:
    return tuple(map(int, tensor.shape)), tuple(tensor.stride()), int(tensor.storage_offset())


@functools.lru_cache(maxsize=256)
def _elements_meet(a: Layout, b: Layout) -> bool:
    """Whether two layouts in one storage reach a common element: computed once per pair of
    layouts, which a partition's outputs repeat micro-batch after micro-batch."""
    return bool(torch.isin(_elements(a), _elements(b)).any())


def _elements(layout: Layout) -> Tensor:
    """The storage indices of a tensor's elements."""
    shape, stride, offset = layout
    found = torch.tensor(offset, dtype=torch.int64)
    for n, step in zip(shape, stride, strict=True):
        found = found.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * step
    return found.flatten()


def versions_at(value: Value, groups: list[frozenset[int]]) -> Noted:
    """The tensors of ``value`` in each of ``groups`` (positions among its leaves), with
    their version counters."""
    leaves = tree_leaves(value)
    return [
        [(k, leaves[k], leaves[k]._version) for k in sorted(g) if isinstance(leaves[k], Tensor)]
        for g in groups
        if max(g) < len(leaves)
    ]


def refuse_written(j: int, noted: Noted) -> None:
    """Refuse partition ``j``'s write into a group of its input that partition ``j - 1``
    returned overlapping (``noted``: each with its version before ``j``'s forward), where
    it received them apart, or as tensors of the graph (each the output of the pipe's own
    autograd function between partitions, whose gradients the write would not follow)."""
    for group in noted:
        written = [k for k, tensor, version in group if tensor._version != version]
        if written and len(group) == 1:
            raise RuntimeError(
                f"partition {j} wrote in place into its input's leaf {written[0]}, which an "
                f"earlier partition also stashed as a skip (or returned sharing memory with "
                f"one): {SKIP_APART}"
            )
        first = group[0][1]
        apart = any(not _meet(first, tensor) for _, tensor, _ in group[1:])
        if written and (apart or any(tensor.requires_grad for _, tensor, _ in group)):
            raise_shared_written(j, f"wrote in place into its input's leaves {written}")


# Why a write into a skip sharing memory with the main path is refused, and the way out.
SKIP_APART = (
    "in the plain model the write shows in both, but between partitions the skip travels "
    "apart from the main path, so it would show in one; stash a copy "
    "(stash(name, h.clone())), or write out of place (h = h + 1)"
)


def raise_shared_written(j: int, what: str) -> None:
    """Raise the refusal of partition ``j``, which ``what``."""
    raise RuntimeError(
        f"partition {j} {what}, which partition {j - 1} returned as tensors sharing memory "
        "(one tensor twice, or a view beside its base): in the plain model the write shows "
        "in each of them, but between partitions each travels on its own, so it would show "
        "in one; return a copy (h.clone()) for all but one of them, or keep the writing "
        "layer in the partition that returns them"
    )
