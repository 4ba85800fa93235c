"""Carrier: the tensor of a layer's input or output on which a skip hangs its ordering edges.

A skip tensor that leaves its partition travels outside the micro-batch, so
no real tensor tells the autograd engine that its gradient must be delivered
before the stashing layer runs its backward. Phony edges tell it
(``pipeline/clock/dependency.py``): the popping layer forks a phony off its input, the
stashing layer joins one into its output. They hang on the first
floating-point tensor of the value, as the driver's own edges do.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from pipeline.clock.dependency import fork, join
from pipeline.runtime.microbatch import Batch

__all__ = ["Carrier"]


class Carrier:
    """A value passing through ``owner`` ("layer Up", "partition 2") that skips fork or join.

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

    def fork(self) -> Tensor:
        """A phony whose gradient the value's backward waits for."""
        batch, index = self._unpacked()
        batch[index], phony = fork(batch[index])
        return phony

    def join(self, phony: Tensor) -> None:
        """Make ``phony``'s backward wait for the value's gradient."""
        batch, index = self._unpacked()
        batch[index] = join(batch[index], phony)

    def _unpacked(self) -> tuple[Batch, int]:
        if self._batch is None:
            if not isinstance(self._value, Tensor | tuple):
                raise TypeError(self._no_carrier(type(self._value).__name__))
            self._batch = Batch(self._value)
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
