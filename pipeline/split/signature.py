"""The call a split model accepts: the example's structure, with the sizes the capture left free.

The first piece checks every call before computing anything: the same
arguments as the example (keywords in any order), tensors of the same
dtypes, constants (``use_cache=False``) equal, and each dimension either the
example's (where the model's code fixed it) or any size in the range the
capture found, equal wherever the code needs equal sizes (the batch of
``input_ids`` and of ``attention_mask``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx
from torch.utils._pytree import TreeSpec, tree_flatten

from pipeline.runtime.microbatch import Arguments
from pipeline.split.dims import Dimension, dimension, expected

__all__ = ["Signature", "in_order"]


@dataclass
class _Tensor:
    name: str
    dtype: torch.dtype
    dims: list[Dimension]


@dataclass
class _Constant:
    name: str
    value: Any


class Signature:
    """The arguments of the captured call, and how their sizes may vary."""

    def __init__(
        self,
        spec: TreeSpec,
        inputs: Sequence[fx.Node],
        names: Sequence[str],
        example: Sequence[Any],
        ranges: dict[str, tuple[int, int | None]],
    ) -> None:
        self.spec = spec
        self.ranges = ranges
        self.leaves = [
            _leaf(node, name, value)
            for node, name, value in zip(inputs, names, example, strict=True)
        ]

    def __deepcopy__(self, memo: dict[int, Any]) -> Signature:
        return self  # immutable, and it refers to no module

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The flat arguments of ``model(*args, **kwargs)``, once they fit; else a clear error."""
        leaves, spec = self._flattened(args, in_order(kwargs, self.spec))
        if spec != self.spec:
            raise TypeError(
                f"this split model takes {_describe(self.spec)}, as in the example it was split "
                f"on, but was called with {_describe(spec)}{_one_tuple(args)}; call it like the "
                "example (or split the model again on an example of this call)"
            )
        tensors = []
        for leaf, value in zip(self.leaves, leaves, strict=True):
            if isinstance(leaf, _Constant):
                _check_constant(leaf, value)
            else:
                tensors.append((leaf, _checked(leaf, value)))
        self._check_sizes(tensors)
        return leaves

    def _flattened(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[Any], TreeSpec]:
        """The call's leaves and structure; one tuple given alone as the positional arguments
        when only that fits: a Pipe of the 'tuple' call style hands the first layer one value,
        a tuple of them, beside the keywords (``pipe((a, b), mask=m)``)."""
        flat = tree_flatten((args, kwargs))
        if flat[1] != self.spec and len(args) == 1 and type(args[0]) is tuple:
            spread = tree_flatten((args[0], kwargs))
            if spread[1] == self.spec:
                return spread
        return flat

    def arguments(self, value: Any) -> dict[str, Any]:
        """A first layer's input (``Arguments``, or the one argument) by name, bound as above.

        The names are the captured call's: ``input_ids``, ``attention_mask``.
        """
        args, kwargs = (
            (value.args, value.kwargs) if isinstance(value, Arguments) else ((value,), {})
        )
        leaves = self.bind(args, kwargs)
        return {leaf.name: v for leaf, v in zip(self.leaves, leaves, strict=True)}

    def _check_sizes(self, tensors: list[tuple[_Tensor, Tensor]]) -> None:
        bound: dict[str, int] = {}
        first: dict[str, str] = {}
        for leaf, tensor in tensors:
            for d, (dim, size) in enumerate(zip(leaf.dims, tensor.shape, strict=True)):
                if isinstance(dim, str):
                    where = f"{leaf.name} dim {d}"
                    seen = bound.setdefault(dim, size)
                    if seen != size:
                        raise ValueError(
                            f"{where} is {size}, but {first[dim]} is {seen}: the model needs "
                            "them equal"
                        )
                    first.setdefault(dim, where)
                    self._check_range(dim, size, where)
        for leaf, tensor in tensors:
            for d, (dim, size) in enumerate(zip(leaf.dims, tensor.shape, strict=True)):
                wanted = expected(dim, bound)
                if wanted is not None and wanted != size:
                    raise ValueError(
                        f"{leaf.name} dim {d} is {size}, but the model's code fixes it to "
                        f"{wanted} ({_fixed(dim)}); split again on an example of this size"
                    )

    def _check_range(self, symbol: str, size: int, where: str) -> None:
        low, high = self.ranges.get(symbol, (0, None))
        if size < low or (high is not None and size > high):
            bound = f"{low} to {high}" if high is not None else f"{low} or more"
            why = (
                ": the code may take another path for a size of 1 than the example took, and "
                "split could not check that it does not"
                if size == 1
                else ""
            )
            raise ValueError(f"{where} is {size}; the split model accepts {bound} there{why}")


def _leaf(node: fx.Node, name: str, value: Any) -> _Tensor | _Constant:
    fake = node.meta.get("val")
    if not isinstance(value, Tensor) or not isinstance(fake, Tensor):
        return _Constant(name, value)
    return _Tensor(name, value.dtype, [dimension(size) for size in fake.shape])


def _checked(leaf: _Tensor, value: Any) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(
            f"{leaf.name} must be a tensor, as in the example, got {type(value).__name__}"
        )
    if value.dtype != leaf.dtype:
        raise TypeError(
            f"{leaf.name} is {value.dtype}, but the model was split on {leaf.dtype}; pass "
            f"{leaf.dtype} or split again on an example of this dtype"
        )
    if value.dim() != len(leaf.dims):
        raise ValueError(
            f"{leaf.name} has {value.dim()} dimensions, but {len(leaf.dims)} in the example"
        )
    return value


def _fixed(dim: Dimension) -> str:
    if isinstance(dim, int) and dim in (0, 1):
        return "a size of 0 or 1 in the example is taken as fixed: split on sizes of 2 or more"
    if isinstance(dim, int):
        return "the example's size: only the sizes the code takes as variables may change"
    return f"it must be {dim}"


def _check_constant(leaf: _Constant, value: Any) -> None:
    same = type(value) is type(leaf.value) and (
        value is leaf.value or (not isinstance(value, Tensor) and value == leaf.value)
    )
    if not same:
        raise ValueError(
            f"{leaf.name} is {value!r}, but the model was split with {leaf.value!r}, which the "
            "captured code depends on; pass the same value or split again with this one"
        )


def in_order(kwargs: dict[str, Any], spec: TreeSpec) -> dict[str, Any]:
    """``kwargs`` in the order of the example's keywords, when they are the same keywords."""
    keys = spec.child(1).context if spec.num_children == 2 else None
    if keys is None or set(keys) != set(kwargs):
        return kwargs
    return {key: kwargs[key] for key in keys}


def _one_tuple(args: tuple[Any, ...]) -> str:
    """What a call of one tuple was taken as, for a message: it did not fit either way."""
    if len(args) != 1 or type(args[0]) is not tuple:
        return ""
    return (
        f" (a tuple of {len(args[0])} values, which does not fit as the positional arguments "
        "either)"
    )


def _describe(spec: TreeSpec) -> str:
    args, kwargs = spec.children()
    keywords = list(kwargs.context or [])
    return f"{args.num_children} positional argument(s) and keyword(s) {keywords}"
