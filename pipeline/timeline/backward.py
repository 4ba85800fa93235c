"""Backward marks: time a task's backward pass from inside the autograd graph.

Backward is run by PyTorch's autograd engine, not by the pipeline, so a task's
backward is timed by marks placed in the graph while the task runs::

    input --> End --> [partition] --> Start --> output

``Start`` records when the output's gradient arrives, ``End`` when the
input's gradient leaves. An input that requires no gradient (the data
entering partition 0) gets no backward node to mark; then every node the
partition created reports when it finishes, and the last report is the end.
The partition's nodes are told apart by their sequence numbers, which each
thread hands out in creation order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import Node

from pipeline.microbatch import TensorOrValues
from pipeline.timeline.event import Event

__all__ = ["BackwardSpan", "run_marked"]


class BackwardSpan:
    """The backward pass of one task, filled in by the autograd engine as it runs."""

    __slots__ = ("end", "microbatch", "partition", "start", "step", "thread")

    def __init__(self, microbatch: int, partition: int, step: int) -> None:
        self.microbatch = microbatch
        self.partition = partition
        self.step = step
        self.thread = ""
        self.start: float | None = None
        self.end: float | None = None

    def begin(self) -> None:
        self.start = time.perf_counter()
        self.thread = threading.current_thread().name

    def finish(self) -> None:
        self.end = time.perf_counter()

    def node_finished(self, grad_inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> None:
        self.finish()

    def event(self) -> Event | None:
        """The finished span as an ``Event``; None while backward has not gone through it."""
        if self.start is None or self.end is None:
            return None
        return Event(
            "backward",
            self.microbatch,
            self.partition,
            self.step,
            self.thread,
            self.start,
            self.end,
        )


def run_marked(
    function: Callable[[TensorOrValues], TensorOrValues], value: TensorOrValues, span: BackwardSpan
) -> TensorOrValues:
    """Run ``function(value)`` with ``span`` marked at its input and output.

    Call it with grad enabled; the output is ``function``'s with its first
    tensor that requires grad passed through ``Start``.
    """
    first_node = torch._C._autograd._get_sequence_nr()
    marked = _first_requiring_grad(value)
    if marked is not None:
        value = _replaced(value, marked, End.apply(_at(value, marked), span))
    output = function(value)
    carrier = _first_requiring_grad(output)
    if carrier is None:
        return output
    tensor = _at(output, carrier)
    if marked is None and tensor.grad_fn is not None:
        created = range(first_node, torch._C._autograd._get_sequence_nr())
        _report_nodes_created(tensor.grad_fn, created, span)
    return _replaced(output, carrier, Start.apply(tensor, span))


def _report_nodes_created(root: Node, created: range, span: BackwardSpan) -> None:
    # Nodes outside ``created`` belong to other tasks, or are gradient
    # accumulators (whose sequence number is the largest there is).
    seen: set[Node] = set()
    pending: list[Node | None] = [root]
    while pending:
        node = pending.pop()
        if node is None or node in seen or node._sequence_nr() not in created:
            continue
        seen.add(node)
        node.register_hook(span.node_finished)
        pending.extend(successor for successor, _ in node.next_functions)


def _first_requiring_grad(value: TensorOrValues) -> int | None:
    values = (value,) if isinstance(value, Tensor) else value
    for index, item in enumerate(values):
        if isinstance(item, Tensor) and item.requires_grad:
            return index
    return None


def _at(value: TensorOrValues, index: int) -> Tensor:
    item = value if isinstance(value, Tensor) else value[index]
    assert isinstance(item, Tensor)
    return item


def _replaced(value: TensorOrValues, index: int, tensor: Tensor) -> TensorOrValues:
    if isinstance(value, Tensor):
        return tensor
    return (*value[:index], tensor, *value[index + 1 :])


class Start(torch.autograd.Function):
    """Identity in forward; the gradient's arrival begins the span in backward."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, span: BackwardSpan) -> Tensor:
        ctx.span = span
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.span.begin()
        return grad, None


class End(torch.autograd.Function):
    """Identity in forward; the gradient's departure ends the span in backward."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, span: BackwardSpan) -> Tensor:
        ctx.span = span
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.span.finish()
        return grad, None
