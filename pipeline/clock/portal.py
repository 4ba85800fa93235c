"""Portals: how a skip tensor goes from one partition to a later one, around those between.

A portal holds one skip tensor of one micro-batch. ``Enter`` puts the
tensor in and returns a phony; ``Exit`` takes a phony and gives the tensor
back. Neither is a path of the micro-batch, so the partitions in between
never see the tensor. When the two partitions are on different devices, the
driver's fence moves the tensor with the same ``Wait``/``Copy``/``Wait`` as
the micro-batches, in the popping task's clock cycle (``skips.py``)::

  partition a: stash           fence of the popping task             partition b: pop

  output --Join--> ... --> input --Fork--------------Join--> ... --> input --Fork--> layer
            ^                        | phony           ^ phony                | phony
            | phony                  v                 |                      v
  tensor -Enter               Exit --> Wait/Copy/Wait --> Enter              Exit --> popped
       (portal holds tensor)  (takes it)          (portal holds the copy)   (takes it)

Backward runs the same way back: the popping ``Exit`` puts the gradient in
the portal; the fence's ``Enter`` takes it and sends it over ``Copy``; the
fence's ``Exit`` puts it back; the stashing ``Enter`` hands it to the
tensor's own history. Each ``Exit`` takes its phony from a ``Fork`` on the
micro-batch's path downstream of the ``Join`` that holds the matching
``Enter``, so the engine cannot reach that ``Enter`` before the ``Exit`` has
put the gradient in the portal, even with a thread per device.

Each ``Exit`` also hangs on the phony of the ``Enter`` it reads from, and
its backward hands that phony a gradient: the micro-batch's path from the
``Join`` to the ``Fork`` may carry no gradient (frozen layers, or no grad,
between the stash and the pop, or before the stash, where no ``Join`` is
drawn at all: ``skips.py``), and then this edge is the one way back to
the tensor; where the path carries one, ``Enter`` waits for both. A skip
that needs no gradient exits as itself, with no node.

Lifetime: the portal lets go of the tensor at the ``Exit`` that reads it, so
nothing outlives its use. Recomputation never reads a portal: the popping
task keeps what its forward popped (``skips.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipeline.clock.phony import get_phony
from pipeline.skip.tracker import StashMark

__all__ = ["Portal"]


class Portal:
    """Holds one skip tensor of one micro-batch, and its gradient on the way back."""

    __slots__ = ("entered", "grad", "mark", "shared", "tensor")

    def __init__(self) -> None:
        self.tensor: Tensor | None = None
        # The gradient an Exit put here, with the backward (graph task) it put it in.
        self.grad: tuple[int, Tensor] | None = None
        self.entered: Tensor | None = None
        self.mark: StashMark | None = None
        # Whether the stashed tensor shares memory with its partition's output or
        # another skip (``runtime/aliases.py``): the pop may not write into it.
        self.shared = False

    def enter(self, tensor: Tensor) -> Tensor:
        """Keep ``tensor`` for one exit; the phony returned carries its gradient edge."""
        self.tensor, self.mark = tensor, StashMark(tensor)
        phony: Tensor = Enter.apply(self, tensor)
        self.entered = phony
        return phony

    def exit(self, phony: Tensor) -> Tensor:
        """The kept tensor, as a new node whose gradient goes back into the portal; itself
        if it needs no gradient (a node on a phony that needs one would make it need one,
        which the popping layer would see)."""
        if self.tensor is not None and not self.tensor.requires_grad:
            self.entered = None
            return self.read()
        entered, self.entered = self.entered, None
        # No enter since: Exit's read says the skip was popped twice.
        tensor: Tensor = Exit.apply(self, phony, phony if entered is None else entered)
        return tensor

    def read(self) -> Tensor:
        tensor, self.tensor = self.tensor, None
        if tensor is None:
            raise RuntimeError("a skip tensor was popped twice from its portal in one forward pass")
        return tensor

    def give_grad(self, grad: Tensor) -> None:
        self.grad = torch._C._current_graph_task_id(), grad

    def take_grad(self) -> Tensor | None:
        """The gradient an Exit put here in this backward. One left by an earlier backward
        that ran the Exit but not this Enter (``autograd.grad`` of another output) is
        not this one's."""
        given, self.grad = self.grad, None
        if given is None or given[0] != torch._C._current_graph_task_id():
            return None
        return given[1]


class Enter(torch.autograd.Function):
    """tensor -> portal; the phony output brings the portal's gradient back to the tensor."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, tensor: Tensor) -> Tensor:
        ctx.portal = portal
        return get_phony(tensor.device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> tuple[None, Tensor | None]:
        return None, ctx.portal.take_grad()


class Exit(torch.autograd.Function):
    """phony (and the entering phony) -> the portal's tensor; its gradient goes into the portal."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, phony: Tensor, entered: Tensor) -> Tensor:
        ctx.portal = portal
        ctx.devices = phony.device, entered.device
        return portal.read().detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, Tensor]:
        ctx.portal.give_grad(grad)
        # A gradient for the entering phony: its Enter runs after this.
        return None, None, get_phony(ctx.devices[1], requires_grad=False)
