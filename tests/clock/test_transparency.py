"""Outputs and gradients of a Pipe equal those of the plain nn.Sequential."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe
from tests.helpers import assert_close_dicts, grads, mlp


def reference(model: nn.Sequential, x: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    x = x.clone().requires_grad_()
    out = model(x)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    assert x.grad is not None
    return out.detach(), grads(model), x.grad


def piped(pipe: Pipe, x: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    x = x.clone().requires_grad_()
    out = pipe(x)
    assert isinstance(out, Tensor)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    assert x.grad is not None
    return out.detach(), grads(pipe), x.grad


@pytest.mark.parametrize("balance", [[6], [1, 5], [3, 3], [2, 2, 2], [1, 1, 1, 1, 1, 1]])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_outputs_and_gradients_match(balance: list[int], chunks: int, checkpoint: str) -> None:
    model = mlp()
    x = torch.randn(10, 8, dtype=torch.float64)  # 10 rows: uneven micro-batches
    expected = reference(model, x)
    pipe = Pipe(
        copy.deepcopy(model),
        balance,
        devices=["cpu"] * len(balance),
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
    )
    out, g, xg = piped(pipe, x)
    torch.testing.assert_close(out, expected[0])
    assert_close_dicts(g, expected[1])
    torch.testing.assert_close(xg, expected[2])


def test_input_without_grad_still_trains_every_partition() -> None:
    model = mlp()
    x = torch.randn(8, 8, dtype=torch.float64)
    model(x).sum().backward()
    expected = grads(model)
    pipe = Pipe(copy.deepcopy(model), [2, 2, 2], devices=["cpu"] * 3, chunks=4)
    pipe.zero_grad()
    pipe(x).sum().backward()  # type: ignore[union-attr]
    assert_close_dicts(grads(pipe), expected)


def test_gradients_accumulate_over_two_steps_like_the_plain_model() -> None:
    model = mlp()
    x = torch.randn(8, 8, dtype=torch.float64)
    for _ in range(2):
        model(x).sum().backward()
    expected = grads(model)
    pipe = Pipe(copy.deepcopy(model), [3, 3], devices=["cpu"] * 2, chunks=4)
    pipe.zero_grad()
    for _ in range(2):
        pipe(x).sum().backward()  # type: ignore[union-attr]
    assert_close_dicts(grads(pipe), expected)


class Scale(nn.Module):
    """Takes (x, factor, name, y); returns (x * factor + y, name)."""

    def forward(self, values: tuple[Tensor, float, str, Tensor]) -> tuple[Tensor, str]:
        x, factor, name, y = values
        return x * factor + y, name


class Branch(nn.Module):
    """Takes (x, name); returns (linear(x), name, x)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, values: tuple[Tensor, str]) -> tuple[Tensor, str, Tensor]:
        x, name = values
        assert name == "tag"
        return self.linear(x), name, x


class Merge(nn.Module):
    def forward(self, values: tuple[Tensor, str, Tensor]) -> Tensor:
        a, _, b = values
        return a * b


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[1, 1, 1], [2, 1], [1, 2]])
def test_tuples_with_non_tensors_cross_partitions(checkpoint: str, balance: list[int]) -> None:
    model = nn.Sequential(Scale(), Branch(), Merge())
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    model((x, 2.0, "tag", y)).sum().backward()
    expected = grads(model), x.grad, y.grad
    x.grad = y.grad = None
    pipe = Pipe(
        copy.deepcopy(model),
        balance,
        devices=["cpu"] * len(balance),
        chunks=3,
        checkpoint=checkpoint,  # type: ignore[arg-type]
    )
    pipe((x, 2.0, "tag", y)).sum().backward()  # type: ignore[union-attr]
    assert_close_dicts(grads(pipe), expected[0])
    torch.testing.assert_close(x.grad, expected[1])
    torch.testing.assert_close(y.grad, expected[2])


def test_tuple_output_is_gathered() -> None:
    pipe = Pipe(nn.Sequential(Scale()), [1], devices=["cpu"], chunks=3)
    x = torch.randn(6, 2)
    out = pipe((x, 3.0, "n", x))
    assert isinstance(out, tuple) and out[1] == "n"
    torch.testing.assert_close(out[0], 4 * x)


def test_no_chunk_tensor_gets_the_gradient_of_every_micro_batch() -> None:
    from pipeline import NoChunk

    class AddBias(nn.Module):
        def forward(self, values: tuple[Tensor, Tensor]) -> Tensor:
            x, bias = values
            return x + bias

    x = torch.randn(8, 3)
    bias = torch.randn(3, requires_grad=True)
    pipe = Pipe(nn.Sequential(AddBias(), nn.Tanh()), [1, 1], devices=["cpu"] * 2, chunks=4)
    pipe((x, NoChunk(bias))).sum().backward()  # type: ignore[union-attr]
    expected_bias = bias.detach().clone().requires_grad_()
    torch.tanh(x + expected_bias).sum().backward()
    torch.testing.assert_close(bias.grad, expected_bias.grad)


def test_eval_and_no_grad_match_the_plain_model() -> None:
    model = mlp()
    x = torch.randn(5, 8, dtype=torch.float64)
    pipe = Pipe(copy.deepcopy(model), [2, 4], devices=["cpu"] * 2, chunks=2)
    pipe.eval()
    with torch.no_grad():
        out = pipe(x)
    assert isinstance(out, Tensor) and not out.requires_grad
    torch.testing.assert_close(out, model(x).detach())
