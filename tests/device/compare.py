"""A model run plainly and in a Pipe on a layout's devices, and the two runs compared.

The plain model runs on the layout's first device, where the Pipe takes its
input; everything the Pipe returns is brought there before comparing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline import Pipe
from tests.device.layouts import Layout
from tests.helpers import grads

MODES = ("always", "except_last", "never")


@dataclass(frozen=True)
class Tolerance:
    """How close two runs must be, and why not closer."""

    rtol: float
    atol: float
    reason: str

    def assert_close(self, actual: Tensor, expected: Tensor, what: str) -> None:
        torch.testing.assert_close(
            actual.to(expected.device),
            expected,
            rtol=self.rtol,
            atol=self.atol,
            msg=lambda found: f"{what}: {found} (tolerance: {self.reason})",
        )


# torch.testing's defaults for float64 (rtol 1e-7, atol 1e-7), as the CPU tests compare.
FLOAT64 = Tolerance(
    1e-7, 1e-7, "float64: the pipe sums micro-batches where the plain model sums rows"
)
EXACT = Tolerance(0.0, 0.0, "the same kernels on the same shapes, the same random numbers")


def pipe_on(
    model: nn.Sequential, layout: Layout, balance: list[int], *, chunks: int, **options: Any
) -> Pipe:
    """A Pipe of a copy of ``model`` split by ``balance`` over ``layout``'s devices.

    A layout of one partition alone takes every layer into it.
    """
    devices = layout.devices(len(balance))
    return Pipe(
        copy.deepcopy(model),
        balance if len(devices) == len(balance) else [sum(balance)],
        devices=devices,
        chunks=chunks,
        threads=layout.threads,  # type: ignore[arg-type]
        **options,
    )


def plain_on(model: nn.Module, layout: Layout) -> nn.Module:
    """A copy of ``model`` on the layout's first device."""
    return copy.deepcopy(model).to(layout.first)


Run = tuple[Tensor, dict[str, Tensor], Tensor]


def forward_backward(module: nn.Module, x: Tensor) -> Run:
    """Output, parameter gradients and input gradient of a weighted sum of the output."""
    module.zero_grad()
    x = x.clone().requires_grad_()
    out = module(x)
    assert isinstance(out, Tensor)
    weights = torch.arange(out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    (out * weights / out.numel()).sum().backward()
    assert x.grad is not None
    return out.detach(), grads(module), x.grad


def assert_runs_close(actual: Run, expected: Run, tolerance: Tolerance, what: str) -> None:
    """The same output, gradients (every one, none missing) and input gradient."""
    tolerance.assert_close(actual[0], expected[0], f"{what}: output")
    assert actual[1].keys() == expected[1].keys(), what
    for name, grad in expected[1].items():
        tolerance.assert_close(actual[1][name], grad, f"{what}: {name}")
    tolerance.assert_close(actual[2], expected[2], f"{what}: input gradient")
