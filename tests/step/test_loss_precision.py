"""A loss divisor in low precision: a tensor count weighs each micro-batch's loss as the
same count given as a number does, and as the plain model's ``loss / N``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from step_models import WIDTH, block, grads
from torch import Tensor, nn

from pipeline import Pipe

CHUNKS = 2


def summed(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output, target, reduction="sum")


def plain_step(model: nn.Module, x: Tensor, y: Tensor, count: Tensor) -> Tensor:
    """The plain model's mean over a count: each micro-batch's sum divided by it."""
    total = torch.zeros((), dtype=x.dtype)
    for xi, yi in zip(x.chunk(CHUNKS), y.chunk(CHUNKS), strict=True):
        loss = summed(model(xi), yi) / count
        loss.backward()
        total = total + loss.detach()
    return total


# Past N = 16384, 1/N is a float16 subnormal: rounded to one, it was off by up to 18%.
@pytest.mark.parametrize("count", [1_000, 1_000_000, 10_000_000, 50_000_000])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_tensor_divisor_gives_the_plain_models_loss_in_low_precision(
    dtype: torch.dtype, count: int
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(block(), block()).to(dtype)
    plain = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randn(4, WIDTH, generator=gen).to(dtype) for _ in range(2))
    expected = plain_step(plain, x, y, torch.tensor(count))
    losses = []
    for divisor in (count, torch.tensor(count)):
        pipe = Pipe(copy.deepcopy(model), [1, 1], devices=["cpu"] * 2, chunks=CHUNKS)
        loss = pipe.step(x, y, summed, loss_reduction="sum", loss_divisor=divisor)
        assert loss.dtype == dtype
        for k, (got, want) in enumerate(zip(grads(pipe), grads(plain), strict=True)):
            assert got is not None and want is not None and torch.equal(got, want), k
        losses.append(loss)
        pipe.close()
    as_number, as_tensor = losses
    assert torch.equal(as_tensor, as_number), (as_tensor.item(), as_number.item())
    assert torch.equal(as_tensor, expected), (as_tensor.item(), expected.item())


def correct(output: Tensor, target: Tensor) -> Tensor:
    return (output.argmax(1) == target).sum()


def test_a_tensor_divisor_weighs_a_count_as_a_number_does() -> None:
    """An integer loss (correct predictions) over a tensor count: a float, not 1/N cast to 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3))
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(12, WIDTH, generator=gen), torch.randint(3, (12,), generator=gen)
    with torch.no_grad():
        expected = correct(model.eval()(x), y) / torch.tensor(12)
    assert expected > 0
    pipe = Pipe(model, [2, 1], devices=["cpu"] * 2, chunks=3)
    as_number, as_tensor = (
        pipe.evaluate(x, y, correct, loss_reduction="sum", loss_divisor=divisor)
        for divisor in (12, torch.tensor(12))
    )
    pipe.close()
    assert as_tensor.dtype == as_number.dtype == expected.dtype
    assert torch.equal(as_tensor, as_number), (as_tensor, as_number)
    torch.testing.assert_close(as_tensor, expected)
