"""Copies into the CPU are finished before the CPU reads them; copies into a GPU are queued.

A non-blocking copy from a GPU into the CPU returns before it is done, and
nothing orders the CPU's reads after it: a CPU partition after a GPU one
(the forward), before one (the backward), a CPU stage receiving from a GPU
stage, or a loss on the CPU scaled by a divisor on a GPU would read stale
memory. On the CPU the copies cannot be raced, so these tests record how
each copy is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from pipeline.clock.copy import Copy
from pipeline.runtime.stream import copy_to, new_stream
from pipeline.step.losses import scaled
from pipeline.step.mail import Message, moved

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


class RecordedCopies(TorchFunctionMode):
    """Records each ``Tensor.to`` as (device, non_blocking) and returns the tensor unmoved."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.device, bool]] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            self.copies.append((torch.device(args[1]), bool(kwargs.get("non_blocking"))))
            return args[0]
        return func(*args, **kwargs)


def test_a_copy_waits_into_the_cpu_and_is_queued_into_a_gpu() -> None:
    x = torch.ones(3)
    with RecordedCopies() as recorded:
        copy_to(x, GPU)
        copy_to(x, CPU, torch.float64)
    assert recorded.copies == [(GPU, True), (CPU, False)]


def test_pipe_copies_stage_messages_and_loss_scales_into_the_cpu_wait() -> None:
    x = torch.ones(3, requires_grad=True)
    stream = new_stream(CPU)
    with RecordedCopies() as recorded:
        Copy.apply(stream, stream, x)  # between partitions
        moved(Message([torch.ones(3, device="meta")]), CPU)  # between stages
        scaled(torch.ones(()), torch.tensor(0.5, dtype=torch.float64))  # a divisor's reciprocal
    assert recorded.copies == [(CPU, False)] * 3
