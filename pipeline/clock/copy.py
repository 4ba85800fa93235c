"""Copy and Wait: autograd functions that move micro-batches between devices.

A micro-batch leaving partition ``j - 1`` for partition ``j`` goes::

    compute stream j-1 --Wait--> copy stream j-1 --Copy--> copy stream j --Wait--> compute stream j

so that copies overlap with computation on both devices. Each function's
backward does the mirror image: ``Copy`` sends the gradient back on the same
pair of copy streams, ``Wait`` makes the gradient's stream wait. On devices
without streams (the CPU) both degrade to a plain ``.to(device)`` and an
identity.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipeline.runtime.stream import (
    Stream,
    copy_to,
    get_device,
    record_stream,
    use_device,
    use_stream,
    wait_stream,
)

__all__ = ["Copy", "Wait"]


class Copy(torch.autograd.Function):
    """Copy tensors from ``prev_stream``'s device to ``next_stream``'s."""

    @staticmethod
    def forward(ctx: Any, prev_stream: Stream, next_stream: Stream, *input: Any) -> Any:
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        return _needing_grad_as(
            ctx, input, tuple(_copy(x, prev_stream, next_stream) for x in input)
        )

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor | None) -> Any:
        # The Wait that follows this Copy in forward has already made the
        # next copy stream wait for the gradient's compute stream.
        grad_input = tuple(
            None if g is None else _copy(g, ctx.next_stream, ctx.prev_stream) for g in grad_output
        )
        return (None, None, *grad_input)


class Wait(torch.autograd.Function):
    """Make ``next_stream`` wait for ``prev_stream`` before it uses the tensors."""

    @staticmethod
    def forward(ctx: Any, prev_stream: Stream, next_stream: Stream, *input: Any) -> Any:
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        wait_stream(next_stream, prev_stream)
        return _needing_grad_as(
            ctx, input, tuple(x.detach() if isinstance(x, Tensor) else x for x in input)
        )

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor | None) -> Any:
        wait_stream(ctx.prev_stream, ctx.next_stream)
        return (None, None, *grad_output)


def _needing_grad_as(
    ctx: Any, inputs: tuple[Any, ...], outputs: tuple[Any, ...]
) -> tuple[Any, ...]:
    """``outputs``, each needing a gradient only if its input does: a function's outputs all
    would where any input does (a mask beside the activation), which the layers would see."""
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(
        *(
            y
            for x, y in zip(inputs, outputs, strict=True)
            if isinstance(y, Tensor) and not (isinstance(x, Tensor) and x.requires_grad)
        )
    )
    return outputs


def _copy(x: Any, source: Stream, target: Stream) -> Any:
    if not isinstance(x, Tensor):
        return x
    with use_device(get_device(target)), use_stream(source), use_stream(target):
        y = copy_to(x, get_device(target))
    # Both tensors are used on streams their allocator does not know about.
    record_stream(x, source)
    record_stream(y, target)
    return y
