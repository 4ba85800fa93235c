"""Autocast on every layout (bfloat16 on the CPU; float16 and bfloat16 on CUDA).

A partition runs in the caller's autocast, in forward and in recomputation,
on its worker thread: the pipe's results are the plain model's under the
same autocast, up to the low precision's rounding of each micro-batch.
"""

from __future__ import annotations

import contextlib

import torch

from tests.device.compare import (
    EXACT,
    MODES,
    Tolerance,
    assert_runs_close,
    forward_backward,
    pipe_on,
    plain_on,
)
from tests.device.layouts import Layout
from tests.helpers import mlp

CHUNKS = 4


def rounded_per_micro_batch(dtype: torch.dtype) -> Tolerance:
    """A weight gradient is rounded to ``dtype`` once per micro-batch, then summed in float32.

    The plain model rounds the whole batch's once: ``CHUNKS`` roundings of
    ``eps`` each apart at most. CUDA may also pick another matmul kernel for
    a micro-batch's rows than for the batch's, rounding the outputs apart by
    as much.
    """
    eps = torch.finfo(dtype).eps
    return Tolerance(CHUNKS * eps, CHUNKS * eps, f"{dtype}: rounded once per micro-batch")


def autocasts(layout: Layout) -> list[torch.dtype]:
    """The low precisions autocast offers on every device of the layout."""
    if layout.cuda and "cpu" not in layout.cycle:
        return [torch.float16, torch.bfloat16]
    return [torch.bfloat16]


def autocast(layout: Layout, dtype: torch.dtype) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device_type in sorted({torch.device(d).type for d in layout.cycle}):
        stack.enter_context(torch.autocast(device_type, dtype=dtype))
    return stack


def test_pipe_under_autocast_equals_the_plain_model_under_it(layout: Layout) -> None:
    model = mlp(dtype=torch.float32)
    x = torch.randn(12, 8, device=layout.first)
    for dtype in autocasts(layout):
        with autocast(layout, dtype):
            expected = forward_backward(plain_on(model, layout), x)
            runs = {
                mode: forward_backward(
                    pipe_on(model, layout, [2, 2, 2], chunks=CHUNKS, checkpoint=mode), x
                )
                for mode in MODES
            }
        what = f"{layout.name}, {dtype}"
        assert expected[0].dtype == runs["never"][0].dtype == dtype, what
        assert_runs_close(runs["never"], expected, rounded_per_micro_batch(dtype), what)
        for mode in ("always", "except_last"):
            # Recomputation runs in the caller's autocast too: the same casts.
            assert_runs_close(runs[mode], runs["never"], EXACT, f"{what}, {mode}")
