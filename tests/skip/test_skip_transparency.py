"""A U-Net-like model with long skips gives the same outputs and gradients in a Pipe."""

from __future__ import annotations

import copy

import pytest
import torch
from skip_models import BALANCE, unet
from torch import nn

from pipeline import Pipe

CPU = ["cpu"] * 4
# 'cpu' and 'cpu:0' compare unequal, so the driver copies at every boundary
# and skips between them take the fence's copy path.
ALTERNATING = ["cpu", "cpu:0", "cpu", "cpu:0"]


def run_plain(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out = model(x)
    (out * out).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


@pytest.mark.parametrize("devices", [CPU, ALTERNATING], ids=["same-device", "copied"])
@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_outputs_and_gradients_equal_the_plain_model(
    devices: list[str], checkpoint: str, chunks: int
) -> None:
    model = unet()
    plain = copy.deepcopy(model)
    x = torch.randn(10, 8, dtype=torch.double)
    expected_out, expected_grad = run_plain(plain, x)

    pipe = Pipe(model, BALANCE, devices=devices, chunks=chunks, checkpoint=checkpoint)
    out, grad = run_plain(pipe, x)

    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(grad, expected_grad)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_input_without_grad_still_trains_every_layer() -> None:
    model = unet()
    plain = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.double)
    plain(x).sum().backward()
    pipe = Pipe(model, BALANCE, devices=ALTERNATING, chunks=3, checkpoint="except_last")
    pipe(x).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_eval_without_grad_equals_the_plain_model() -> None:
    model = unet()
    plain = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.double)
    pipe = Pipe(model, BALANCE, devices=ALTERNATING, chunks=3).eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x))
    with torch.inference_mode():
        torch.testing.assert_close(pipe(x), plain(x))


def test_several_steps_keep_matching_the_plain_model() -> None:
    model = unet()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, BALANCE, devices=ALTERNATING, chunks=4, checkpoint="except_last")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    for step in range(3):
        x = torch.randn(8, 8, dtype=torch.double, generator=torch.Generator().manual_seed(step))
        for module, optimizer in zip((pipe, plain), optimizers, strict=True):
            optimizer.zero_grad()
            module(x).pow(2).mean().backward()
            optimizer.step()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q)
