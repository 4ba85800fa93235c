"""What a forward's output says about the coming backward: its tensors and the leaves it reaches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a module's output: a tensor, or lists, tuples and dicts of them."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from tensors_in(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from tensors_in(item)


def leaves_reached(outputs: list[torch.Tensor]) -> set[int]:
    """The ids of the leaf tensors whose gradients a backward from `outputs` would accumulate.

    Walks the autograd graph from the outputs' grad_fn nodes down to their
    AccumulateGrad nodes, each of which holds one leaf as `variable`.
    """
    reached = {id(t) for t in outputs if t.requires_grad and t.grad_fn is None}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor):
            reached.add(id(leaf))
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return reached
