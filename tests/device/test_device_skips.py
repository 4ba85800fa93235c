"""Skips across partitions on every layout of several partitions: the plain model's results."""

from __future__ import annotations

import pytest
import torch

from tests.device.compare import (
    FLOAT64,
    MODES,
    assert_runs_close,
    forward_backward,
    pipe_on,
    plain_on,
)
from tests.device.layouts import Layout
from tests.skip.skip_models import BALANCE, WIDTH, unet


@pytest.mark.parametrize("checkpoint", MODES)
def test_skips_crossing_one_to_three_partitions(several: Layout, checkpoint: str) -> None:
    model = unet()
    x = torch.randn(9, WIDTH, dtype=torch.float64, device=several.first)
    expected = forward_backward(plain_on(model, several), x)
    pipe = pipe_on(model, several, BALANCE, chunks=3, checkpoint=checkpoint)
    found = forward_backward(pipe, x)
    assert_runs_close(found, expected, FLOAT64, f"{several.name}, {checkpoint}")
