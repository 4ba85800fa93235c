"""Backward hooks: time a task's backward pass from inside the autograd graph.

Backward is run by PyTorch's autograd engine, not by the pipeline, so a task's
backward is timed by gradient hooks placed while the task runs::

    input --> [partition] --> output
      ^                         ^
      end: its gradient is      start: its gradient
      computed                  arrives

A hook on a tensor fires when the gradient with respect to it is complete,
so the output's hook starts the span and the input's ends it. An input that
requires no gradient (the data entering partition 0) has no gradient to
hook; then every backward node the partition created reports when it
finishes, and the last report is the end. The partition's nodes are told
apart by their sequence numbers, which each thread hands out in creation
order. Hooks leave the graph and its tensors as they are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import Node
from torch.utils._pytree import tree_leaves

from pipeline.runtime.microbatch import Value
from pipeline.trace.event import Event

__all__ = ["BackwardSpan", "run_hooked"]


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

    def begin(self, grad: Tensor) -> None:
        """Gradient hook on the task's output."""
        self.start = time.perf_counter()
        self.thread = threading.current_thread().name

    def finish(self, grad: Tensor) -> None:
        """Gradient hook on the task's input."""
        self.end = time.perf_counter()

    def node_finished(self, grad_inputs: Sequence[Any], grad_outputs: Sequence[Any]) -> None:
        """Post-hook on each backward node of a task whose input has no gradient."""
        self.end = time.perf_counter()

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


def run_hooked(function: Callable[[Value], Value], value: Value, span: BackwardSpan) -> Value:
    """Run ``function(value)`` with ``span`` hooked to its input and output gradients.

    Call it with grad enabled; ``function``'s output is returned as it is::

        span = BackwardSpan(microbatch=0, partition=1, step=0)
        output = run_hooked(partition, x, span)
        output.sum().backward()  # span.event() is now the backward's Event
    """
    first_node = torch._C._autograd._get_sequence_nr()
    input = _first_requiring_grad(value)
    if input is not None:
        input.register_hook(span.finish)
    output = function(value)
    carrier = _first_requiring_grad(output)
    if carrier is None:
        return output
    if input is None and carrier.grad_fn is not None:
        created = range(first_node, torch._C._autograd._get_sequence_nr())
        _report_nodes_created(carrier.grad_fn, created, span)
    carrier.register_hook(span.begin)
    return output


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


def _first_requiring_grad(value: Value) -> Tensor | None:
    for item in tree_leaves(value):
        if isinstance(item, Tensor) and item.requires_grad:
            return item
    return None
