"""pipe(x) on every layout: the plain model's outputs and gradients; dropout replayed exactly."""

from __future__ import annotations

import pytest
import torch

from tests.device.compare import (
    EXACT,
    FLOAT64,
    MODES,
    assert_runs_close,
    forward_backward,
    pipe_on,
    plain_on,
)
from tests.device.layouts import Layout
from tests.device.models import dropped
from tests.helpers import mlp


@pytest.mark.parametrize("checkpoint", MODES)
def test_outputs_and_every_gradient_equal_the_plain_model(layout: Layout, checkpoint: str) -> None:
    model = mlp()
    x = torch.randn(10, 8, dtype=torch.float64, device=layout.first)  # uneven micro-batches
    expected = forward_backward(plain_on(model, layout), x)
    pipe = pipe_on(model, layout, [2, 2, 2], chunks=4, checkpoint=checkpoint)
    for what in ("first call", "second call"):  # the second reuses the copy streams
        found = forward_backward(pipe, x)
        assert found[0].device == torch.device(layout.devices(3)[-1])
        assert_runs_close(found, expected, FLOAT64, f"{layout.name}, {checkpoint}, {what}")


def test_checkpoint_modes_agree_bit_for_bit_with_dropout(layout: Layout) -> None:
    model = dropped()
    x = torch.randn(12, 8, dtype=torch.float64, device=layout.first)
    pipes = {mode: pipe_on(model, layout, [4, 4, 4], chunks=4, checkpoint=mode) for mode in MODES}
    outputs = []
    for seed in range(2):
        runs = {}
        for mode, pipe in pipes.items():
            torch.manual_seed(seed)
            runs[mode] = forward_backward(pipe, x)
        for mode in ("always", "except_last"):
            assert_runs_close(runs[mode], runs["never"], EXACT, f"{layout.name}, {mode}, {seed}")
        outputs.append(runs["never"][0])
    # The masks are drawn anew from each seed: the comparison compared random runs.
    assert not torch.equal(outputs[0], outputs[1])
