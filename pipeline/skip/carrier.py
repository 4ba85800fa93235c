"""Carrier: a layer's input or output as a skip sees it, unpacked only when an engine needs
one of its tensors.

A skip tensor that leaves its partition travels outside the micro-batch; the
``pipe(x)`` engine then draws phony edges (``pipeline/clock/skips.py``) on
the first floating-point tensor of the popping layer's input and of the
stashing layer's output, as its driver does on micro-batches.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from pipeline.runtime.microbatch import Batch

__all__ = ["Carrier"]


class Carrier:
    """A value passing through ``owner`` ("layer Up", "partition 2") that a skip may hang edges on.

    The value is only unpacked when an edge is drawn, so a skip that stays
    in its partition costs nothing here.
    """

    __slots__ = ("_batch", "_owner", "_role", "_value")

    def __init__(self, value: Any, owner: str, role: str) -> None:
        self._value = value
        self._batch: Batch | None = None
        self._owner = owner
        self._role = role

    @classmethod
    def around(cls, batch: Batch, owner: str, role: str) -> Carrier:
        """A carrier that draws its edges on ``batch`` in place."""
        carrier = cls(None, owner, role)
        carrier._batch = batch
        return carrier

    @property
    def owner(self) -> str:
        return self._owner

    @property
    def value(self) -> Any:
        """The value with any edges drawn so far."""
        return self._value if self._batch is None else self._batch.value

    def unpacked(self) -> tuple[Batch, int]:
        """The value as a ``Batch`` edited in place, and the index of the tensor carrying edges.

        A clear ``TypeError`` if the value holds no floating-point tensor.
        """
        if self._batch is None:
            if not isinstance(self._value, Tensor | tuple):
                raise TypeError(self._no_carrier(type(self._value).__name__))
            self._batch = Batch(self._value)
        # One that carries a gradient if any: an edge on another would make it need one.
        found = self._batch.tensor_indices()
        index = next((k for k in found if self._batch[k].requires_grad), None)
        if index is None:
            index = self._batch.first_differentiable()
        if index is None:
            kinds = ", ".join(type(v).__name__ for v in self._batch.leaves)
            raise TypeError(self._no_carrier(f"({kinds}) without a floating-point tensor"))
        return self._batch, index

    def _no_carrier(self, found: str) -> str:
        return (
            f"the {self._role} of {self._owner} must hold a floating-point tensor for a skip "
            f"between partitions to order its gradient on, got {found}"
        )
