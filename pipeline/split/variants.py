"""Variants: a second capture, in the other mode and on one row, to learn what the graph covers.

See ``compare.py`` for why. The common case costs one more capture: in the
other mode, on the example cut to one row. If it matches, one graph serves
both modes and any batch size. If not, the questions are asked apart (at
most two more captures) so that each keeps what it can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from pipeline.split.capture import Captured, capture, modes_set
from pipeline.split.compare import first_difference
from pipeline.split.errors import SplitError
from pipeline.split.signature import in_order

__all__ = ["Variants", "batch_symbols", "variants"]


@dataclass
class Variants:
    """What the captured graph holds for beyond the example's mode and sizes."""

    # The graph is the same in both modes but for the dropouts' train flags.
    dropouts_follow_mode: bool
    # The free batch sizes (dim 0 of the arguments) that may be 1 too.
    one_row: set[str]


def variants(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    blocks: dict[nn.Module, str],
    names: dict[nn.Module, str],
    first: Captured,
) -> Variants:
    """Capture again to learn whether ``first`` holds in the other mode and for one row."""
    batch = batch_symbols(first)
    one = _one_row(first, args, kwargs, batch) if batch else (args, kwargs)

    def same(training: bool, call: tuple[Any, Any]) -> bool:
        try:
            with modes_set(model, training):
                other = capture(model, call[0], call[1], blocks, names)
        except SplitError:
            return False
        return first_difference(first, other, modes=True) is None

    if same(not first.training, one):
        return Variants(True, batch)
    if not batch:
        return Variants(False, set())
    if same(not first.training, (args, kwargs)):
        return Variants(True, set())
    return Variants(False, batch if same(first.training, one) else set())


def batch_symbols(captured: Captured) -> set[str]:
    """The free sizes at dimension 0 of the model's tensor arguments."""
    found: set[str] = set()
    for node in captured.inputs():
        fake = node.meta.get("val")
        if isinstance(fake, Tensor) and fake.dim() > 0 and isinstance(fake.shape[0], torch.SymInt):
            found.add(str(fake.shape[0].node.expr))
    return found


def _one_row(
    captured: Captured, args: tuple[Any, ...], kwargs: dict[str, Any], batch: set[str]
) -> tuple[Any, Any]:
    """The example with every batch dimension (wherever it shows) cut to one row."""
    leaves, spec = tree_flatten((args, in_order(kwargs, captured.spec)))
    cut = []
    for node, leaf in zip(captured.inputs(), leaves, strict=True):
        fake = node.meta.get("val")
        if isinstance(leaf, Tensor) and isinstance(fake, Tensor):
            for d, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt) and str(size.node.expr) in batch:
                    leaf = leaf.narrow(d, 0, 1)
        cut.append(leaf)
    one_args, one_kwargs = tree_unflatten(cut, spec)
    return one_args, one_kwargs
