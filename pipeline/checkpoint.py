"""Activation checkpointing: drop a partition's activations, recompute at backward.

A checkpointed task runs its partition under ``no_grad`` inside ``Checkpoint``
and keeps only the inputs. Just before the partition's backward for that
micro-batch, ``Recompute`` runs the partition again with grad enabled (same
random state, same autocast state), and ``Checkpoint``'s backward
back-propagates through the recomputed graph::

    input --> Checkpoint --> output --> Join --> (next partition)
        \\                      |         ^
         \\                     v         |
          +---------------> Recompute --phony

``Recompute`` takes ``Checkpoint``'s output as an input, so in backward
``Checkpoint`` cannot run before ``Recompute`` has: the order is fixed by the
graph, not by the engine's scheduling.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.dependency import join
from pipeline.microbatch import Batch, TensorOrValues
from pipeline.phony import get_phony
from pipeline.threadstate import ThreadState

__all__ = ["Checkpointing", "is_checkpointing", "is_recomputing", "starts_in_place"]

Function = Callable[[TensorOrValues], TensorOrValues]

_flags = threading.local()


def is_checkpointing() -> bool:
    """Whether the calling layer runs in the forward pass of a checkpointed task.

    A layer with side effects (statistics, counters) can skip them here or in
    recomputation so that they happen once::

        if not is_recomputing():
            self.calls += 1
    """
    return bool(getattr(_flags, "checkpointing", False))


def is_recomputing() -> bool:
    """Whether the calling layer runs in the recomputation of a checkpointed task."""
    return bool(getattr(_flags, "recomputing", False))


@contextmanager
def _flag(name: str) -> Iterator[None]:
    previous = getattr(_flags, name, False)
    setattr(_flags, name, True)
    try:
        yield
    finally:
        setattr(_flags, name, previous)


class Checkpointing:
    """Checkpoints one task: ``checkpoint()`` in forward, ``recompute()`` in backward.

    ``replay_rng`` re-enters the random state of the forward pass; ``state``
    carries the forward's autocast state into recomputation. Recomputation
    starts from the inputs the forward pass saw, so a function that writes
    into its inputs (an in-place first layer) gets copies: ``protect_inputs``.
    """

    def __init__(
        self,
        function: Function,
        device: torch.device,
        state: ThreadState,
        replay_rng: Callable[[], AbstractContextManager[None]],
        *,
        partition: int,
        protect_inputs: bool,
    ) -> None:
        self.function = function
        self.partition = partition
        self.device = device
        self.state = state
        self.replay_rng = replay_rng
        self.protect_inputs = protect_inputs
        self.atomic = True
        self.recomputed: tuple[TensorOrValues, list[Any]] | None = None

    def checkpoint(self, batch: Batch) -> Batch:
        """Run the function on ``batch`` without keeping activations; wire up recomputation."""
        self.atomic = batch.atomic
        phony = get_phony(self.device, requires_grad=True)
        with _flag("checkpointing"):
            output = Checkpoint.apply(phony, self, *batch.values)
        out = Batch(output)
        carrier = out.first_differentiable()
        if carrier is not None and out[carrier].requires_grad:
            phony = Recompute.apply(out[carrier], self, *batch.values)
            out[carrier] = join(out[carrier], phony)
        return out

    def call(self, inputs: list[Any] | tuple[Any, ...]) -> TensorOrValues:
        if self.protect_inputs:
            inputs = [x.clone() if isinstance(x, Tensor) else x for x in inputs]
        return self.function(inputs[0] if self.atomic else tuple(inputs))

    def call_without_grad(self, inputs: tuple[Any, ...]) -> TensorOrValues:
        """The forward pass: no activations kept, inputs left as they were."""
        versions = [x._version for x in inputs if isinstance(x, Tensor)]
        with torch.no_grad():
            output = self.call(inputs)
        if versions != [x._version for x in inputs if isinstance(x, Tensor)]:
            raise RuntimeError(
                f"checkpointed partition {self.partition} modified its input in place, so "
                "recomputation would start from the modified values; give its first layer an "
                "attribute inplace=True (the Pipe then hands it a copy), make that layer "
                "out-of-place, or use checkpoint='never'"
            )
        return output

    def recompute(self, inputs: list[Any]) -> None:
        """Run the function again with grad, as in the forward pass; keep the graph."""
        leaves = [_detached_leaf(x) for x in inputs]
        with (
            self.replay_rng(),
            self.state.autocast_applied(self.device),
            torch.enable_grad(),
            _flag("recomputing"),
        ):
            output = self.call(leaves)
        self.recomputed = (output, leaves)


def _detached_leaf(x: Any) -> Any:
    if not isinstance(x, Tensor):
        return x
    return x.detach().requires_grad_(x.requires_grad)


def starts_in_place(partition: nn.Sequential) -> bool:
    """Whether the first layer of ``partition`` declares that it writes into its input."""
    first: nn.Module = partition
    while isinstance(first, nn.Sequential) and len(first) > 0:
        first = first[0]
    return getattr(first, "inplace", False) is True


class Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, phony: Tensor, chk: Checkpointing, *inputs: Any) -> Any:
        ctx.chk = chk
        return chk.call_without_grad(inputs)

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor | None) -> Any:
        chk: Checkpointing = ctx.chk
        assert chk.recomputed is not None, "Recompute runs before Checkpoint in backward"
        output, leaves = chk.recomputed
        chk.recomputed = None
        outputs = (output,) if isinstance(output, Tensor) else output
        pairs = [
            (o, g)
            for o, g in zip(outputs, grad_output, strict=True)
            if isinstance(o, Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grad_inputs = [
            x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in leaves
        ]
        return (None, None, *grad_inputs)


class Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dependency: Tensor, chk: Checkpointing, *inputs: Any) -> Tensor:
        ctx.chk = chk
        ctx.tensor_positions = [i for i, x in enumerate(inputs) if isinstance(x, Tensor)]
        ctx.others = [None if isinstance(x, Tensor) else x for x in inputs]
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_positions))
        return get_phony(dependency.device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> Any:
        inputs = list(ctx.others)
        for position, tensor in zip(ctx.tensor_positions, ctx.saved_tensors, strict=True):
            inputs[position] = tensor
        ctx.chk.recompute(inputs)
        return (None, None, *(None for _ in inputs))
