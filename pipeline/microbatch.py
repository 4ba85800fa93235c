"""Micro-batches: scatter a mini-batch into micro-batches and gather them back.

A partition takes and returns either one tensor or a tuple of values. Tensors
in the input are split along dim 0; everything else (non-tensors, and tensors
wrapped in ``NoChunk``) reaches every micro-batch unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeAlias, cast

import torch
from torch import Tensor

__all__ = ["Batch", "NoChunk", "check_input", "gather", "scatter"]

Values: TypeAlias = tuple[Any, ...]
TensorOrValues: TypeAlias = Tensor | Values


class NoChunk:
    """Wraps a tensor that every micro-batch receives whole, unsplit.

    Example::

        mask = torch.ones(seq_len, seq_len)
        out = pipe((tokens, NoChunk(mask)))  # tokens split, mask shared
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"NoChunk wraps a tensor, got {type(tensor).__name__}")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"NoChunk({self.tensor!r})"


class Batch:
    """One micro-batch as it travels between partitions.

    ``atomic`` batches hold a single tensor; others hold a tuple of values.
    """

    __slots__ = ("atomic", "values")

    def __init__(self, value: TensorOrValues) -> None:
        self.atomic = isinstance(value, Tensor)
        self.values: list[Any] = [value] if self.atomic else list(value)

    @property
    def value(self) -> TensorOrValues:
        """What a partition receives: the tensor, or the tuple of values."""
        return cast(Tensor, self.values[0]) if self.atomic else tuple(self.values)

    def call(self, function: Callable[[TensorOrValues], TensorOrValues]) -> Batch:
        return Batch(function(self.value))

    def tensor_indices(self) -> Iterator[int]:
        return (i for i, v in enumerate(self.values) if isinstance(v, Tensor))

    def first_differentiable(self) -> int | None:
        """Index of the first floating tensor: the carrier of phony edges."""
        for i in self.tensor_indices():
            if self.values[i].is_floating_point() or self.values[i].is_complex():
                return i
        return None

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: int) -> Any:
        return self.values[index]

    def __setitem__(self, index: int, value: Any) -> None:
        self.values[index] = value

    def __repr__(self) -> str:
        return f"Batch(atomic={self.atomic}, values={self.values!r})"


def check_input(input: Any) -> None:
    """Raise a clear error unless ``input`` can be split into micro-batches."""
    if isinstance(input, Tensor):
        values: Values = (input,)
    elif isinstance(input, tuple):
        values = input
    else:
        raise TypeError(
            f"Pipe input must be a Tensor or a tuple of values, got {type(input).__name__}; "
            "pass several inputs as a tuple"
        )
    sizes = {}
    for index, value in enumerate(values):
        if isinstance(value, Tensor):
            if value.dim() == 0:
                raise ValueError(
                    f"input tensor at position {index} is a scalar and cannot be split into "
                    "micro-batches; wrap it in NoChunk to pass it to every micro-batch"
                )
            sizes[index] = value.size(0)
    if not sizes:
        raise TypeError(
            "Pipe input holds no tensor to split into micro-batches (NoChunk tensors are "
            "not split); pass at least one tensor with a batch dimension"
        )
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"position {i}: {n}" for i, n in sizes.items())
        raise ValueError(
            f"input tensors disagree on the batch size (dim 0): {listed}; every split tensor "
            "must have the same dim 0, wrap the others in NoChunk"
        )
    if 0 in sizes.values():
        raise ValueError("input batch is empty (dim 0 has size 0)")


def scatter(input: TensorOrValues, chunks: int) -> list[Batch]:
    """Split ``input`` into at most ``chunks`` micro-batches along dim 0.

    Follows ``Tensor.chunk``: 10 rows in 4 chunks gives 3, 3, 3 and 1 rows,
    and 3 rows in 4 chunks gives 3 micro-batches of one row.
    """
    if isinstance(input, Tensor):
        return [Batch(piece) for piece in input.chunk(chunks)]

    columns: list[tuple[Any, ...] | None] = []
    count = None
    for value in input:
        if isinstance(value, Tensor):
            pieces = value.chunk(chunks)
            count = len(pieces)
            columns.append(pieces)
        else:
            columns.append(None)
    assert count is not None, "check_input guarantees a tensor"
    return [
        Batch(tuple(_piece(value, column, i) for value, column in zip(input, columns, strict=True)))
        for i in range(count)
    ]


def _piece(value: Any, column: tuple[Any, ...] | None, index: int) -> Any:
    if column is not None:
        return column[index]
    if isinstance(value, NoChunk):
        return value.tensor
    return value


def gather(batches: list[Batch]) -> TensorOrValues:
    """Concatenate the micro-batches' outputs back into one mini-batch.

    Tensors are concatenated along dim 0. A non-tensor output must be equal in
    every micro-batch and is returned once.
    """
    if batches[0].atomic:
        return torch.cat([b.values[0] for b in batches])
    width = len(batches[0])
    if any(len(b) != width or b.atomic for b in batches):
        raise TypeError(
            "the last partition returned outputs of different structure per micro-batch"
        )
    return tuple(_gather_column([b.values[k] for b in batches], k) for k in range(width))


def _gather_column(column: list[Any], position: int) -> Any:
    first = column[0]
    if isinstance(first, Tensor):
        return torch.cat(column)
    if any(value != first for value in column[1:]):
        raise ValueError(
            f"output at position {position} is a non-tensor that differs between micro-batches "
            f"({column!r}); return it as a tensor with a batch dimension to gather it"
        )
    return first
