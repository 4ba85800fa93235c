"""Layers that write into their input, at the start of a partition."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe
from tests.helpers import assert_close_dicts, grads


class DoubleInPlace(nn.Module):
    """x.mul_(2).add_(1): not idempotent, so a wrong recomputation shows."""

    def __init__(self, declare: bool) -> None:
        super().__init__()
        if declare:
            self.inplace = True

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2).add_(1)


def model_starting_partitions_with(layer: nn.Module) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 4),
        copy.deepcopy(layer),
        nn.Linear(4, 4),
        copy.deepcopy(layer),
        nn.Linear(4, 4),
    ).double()


@pytest.mark.parametrize("layer", [nn.ReLU(inplace=True), DoubleInPlace(declare=True)])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("hooked", [False, True])
def test_in_place_first_layers_train_like_the_plain_model(
    layer: nn.Module, checkpoint: str, hooked: bool
) -> None:
    model = model_starting_partitions_with(layer)
    x = torch.randn(8, 4, dtype=torch.float64)
    reference = copy.deepcopy(model)
    reference(x).sum().backward()
    pipe = Pipe(model, [1, 2, 2], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    if hooked:
        pipe.register_partition_backward_hook(lambda j: None)
    out = pipe(x)
    torch.testing.assert_close(out, reference(x))
    out.sum().backward()  # type: ignore[union-attr]
    assert_close_dicts(grads(pipe), grads(reference))


def test_undeclared_in_place_first_layer_is_a_clear_error_under_checkpointing() -> None:
    pipe = Pipe(
        model_starting_partitions_with(DoubleInPlace(declare=False)),
        [1, 2, 2],
        devices=["cpu"] * 3,
        chunks=2,
        checkpoint="always",
    )
    with pytest.raises(RuntimeError, match="checkpointed partition 1 modified its input in place"):
        pipe(torch.randn(4, 4, dtype=torch.float64))


def summed_squares(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target, reduction="sum")


@pytest.mark.parametrize("layer", [nn.ReLU(inplace=True), DoubleInPlace(declare=True)])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_in_place_first_layers_step_like_the_plain_model(
    layer: nn.Module, checkpoint: str, schedule: str
) -> None:
    # A later partition's input is a leaf of its own graph, which no layer may write
    # into: a declared in-place first layer gets a copy in every task.
    model = model_starting_partitions_with(layer)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    reference = copy.deepcopy(model)
    expected = summed_squares(reference(x), y)
    expected.backward()
    pipe = Pipe(model, [1, 2, 2], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    loss = pipe.step(x, y, summed_squares, schedule=schedule, loss_reduction="sum")
    torch.testing.assert_close(loss, expected.detach())
    assert_close_dicts(grads(pipe), grads(reference))
    pipe.close()
