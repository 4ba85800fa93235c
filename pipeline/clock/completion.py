"""Completion signals: tell a listener when a partition's gradients are final.

Inside a Pipe a parameter's gradient is accumulated once per micro-batch, so a
gradient hook firing does not mean the gradient is complete. A partition's
gradients are complete once the backward of every micro-batch has gone
through it, which is when the gradient reaches each micro-batch's input to
that partition. ``Arrival`` marks those inputs::

    (micro-batch i) --> Arrival --> [partition j] --> ...
                          |
             backward: count i done; after the m-th, call hooks(j)

``Arrival`` is created on the partition's worker before the partition runs,
so the autograd engine runs it after the partition's own backward nodes
(and the gradient accumulations they trigger), which were created later.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from pipeline.runtime.partitions import Hook

__all__ = ["Arrival", "PartitionCompletion"]


class PartitionCompletion:
    """Counts the micro-batches back-propagated through one partition in one step."""

    def __init__(self, partition: int, expected: int, hooks: list[Hook]) -> None:
        self.partition = partition
        self.expected = self.remaining = expected
        self.hooks = hooks
        self._lock = threading.Lock()

    def arrived(self) -> None:
        with self._lock:
            self.remaining -= 1
            done = self.remaining == 0
            if done:  # a second backward through the same graph (retain_graph) counts anew
                self.remaining = self.expected
        if done:
            for hook in self.hooks:
                hook(self.partition)


class Arrival(torch.autograd.Function):
    """Identity in forward; reports the gradient's arrival in backward."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, completion: PartitionCompletion) -> Tensor:
        ctx.completion = completion
        # detach(), unlike a view, lets the partition write into its input.
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.completion.arrived()
        return grad, None
