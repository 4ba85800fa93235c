"""Fork and join: explicit autograd edges that order the backward pass.

GPipe runs the backward of micro-batch ``i - 1`` on a partition only after
the backward of micro-batch ``i`` on that partition is done. No real tensor
links the two micro-batches, so a phony one does::

        micro-batch i-1                      micro-batch i
    --> [partition j] --> Fork --> ...   --> Join --> [partition j] -->
                            |                 ^
                            +---- phony ------+

In backward, ``Fork`` waits for a gradient from every output, including the
phony; the phony's gradient only arrives once ``Join`` has run, that is once
micro-batch ``i`` has been back-propagated through partition ``j``.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.clock.phony import get_phony

__all__ = ["depend", "fork", "join"]


class Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: torch.Tensor, grad_phony: torch.Tensor) -> torch.Tensor:
        return grad_input


class Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, phony: torch.Tensor) -> torch.Tensor:
        ctx.phony_device = phony.device
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_input, get_phony(ctx.phony_device, requires_grad=False)


def fork(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch a phony tensor off ``input`` (identity on ``input``)."""
    if torch.is_grad_enabled() and input.requires_grad:
        output, phony = Fork.apply(input)
        return output, phony
    return input, get_phony(input.device, requires_grad=False)


def join(input: torch.Tensor, phony: torch.Tensor) -> torch.Tensor:
    """Merge ``phony`` into ``input`` (identity on ``input``)."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        output: torch.Tensor = Join.apply(input, phony)
        return output
    return input


def depend(before: torch.Tensor, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the backward through ``before`` wait for the backward through ``after``.

    Returns the replacements for both tensors; use them in place of the
    originals from here on.
    """
    before, phony = fork(before)
    return before, join(after, phony)
