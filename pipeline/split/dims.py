"""Sizes as a capture saw them: fixed, free (a symbol's name), or an expression of free ones.

At run time the free sizes are bound from real tensors (``bind``) and the
others checked against what they stand for (``expected``), so that the
shapes a capture relied on are checked, never assumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import torch

__all__ = ["Dimension", "bind", "dimension", "expected"]

# An int (fixed), a str (the name of a free size), or a sympy expression of free sizes.
Dimension: TypeAlias = Any


def dimension(size: int | torch.SymInt) -> Dimension:
    """What ``size`` (a dimension of a fake tensor) stands for."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if expr.is_Symbol:
        return str(expr)
    if expr.is_Integer:
        return int(expr)
    return expr


def bind(dims: Sequence[Dimension], shape: Sequence[int], bound: dict[str, int]) -> None:
    """Record the value of each free size of ``dims`` that ``shape`` shows, if not yet known."""
    for dim, size in zip(dims, shape, strict=False):
        if isinstance(dim, str):
            bound.setdefault(dim, size)


def expected(dim: Dimension, bound: dict[str, int]) -> int | None:
    """The size ``dim`` stands for with the sizes ``bound`` so far (None if not all known)."""
    if isinstance(dim, int):
        return dim
    if isinstance(dim, str):
        return bound.get(dim)
    known = {symbol: bound[str(symbol)] for symbol in dim.free_symbols if str(symbol) in bound}
    if len(known) != len(dim.free_symbols):
        return None
    return int(dim.xreplace(known))
