"""DeferredBatchNorm on every layout: the running statistics of BatchNorm over the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.device.compare import FLOAT64, MODES, forward_backward, pipe_on, plain_on
from tests.device.layouts import Layout


def normalised(width: int = 6) -> nn.Sequential:
    torch.manual_seed(4)
    # One BatchNorm, in partition 1: a later one's input would be normalised
    # per micro-batch, its statistics rightly not the plain model's.
    return nn.Sequential(
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.BatchNorm1d(width),
        nn.Tanh(),
        nn.Linear(width, width),
    ).double()


@pytest.mark.parametrize("checkpoint", MODES)
def test_running_statistics_equal_the_plain_models(layout: Layout, checkpoint: str) -> None:
    model = normalised()
    plain = plain_on(model, layout)
    pipe = pipe_on(
        model, layout, [2, 2, 2], chunks=4, checkpoint=checkpoint, deferred_batch_norm=True
    )
    for _ in range(2):
        x = torch.randn(12, 6, dtype=torch.float64, device=layout.first)
        # Normalised per micro-batch, the outputs and gradients are not the
        # plain model's; the running statistics are, once committed.
        forward_backward(plain, x)
        forward_backward(pipe, x)
    state = pipe.state_dict()
    for name, value in plain.state_dict().items():
        FLOAT64.assert_close(state[name], value, f"{layout.name}, {checkpoint}: {name}")
