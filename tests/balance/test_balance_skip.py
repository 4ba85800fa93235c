"""Profiling a model with skip connections and in-place layers, then training it."""

from __future__ import annotations

import copy
from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor, nn

from balance import BalanceError as BalanceErrorFromBalance
from balance import balance_by_size, balance_by_time
from pipeline import BalanceError, Pipe
from pipeline.skip import pop, skippable, stash


@skippable(stash=["skip"])
class Save(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("skip", x)
        return x


@skippable(pop=["skip"])
class Add(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return x + skip


def skip_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 8),
        Save(),
        nn.Linear(8, 8),
        nn.ReLU(inplace=True),
        nn.Linear(8, 8),
        nn.ReLU(inplace=True),
        Add(),
        nn.Linear(8, 2),
    )


def test_skip_model_profiles_and_trains() -> None:
    model = skip_model()
    before = copy.deepcopy(model.state_dict())
    sample = torch.randn(4, 8)
    by_time = balance_by_time(2, model, sample, timeout=0.05, device="cpu")
    by_size = balance_by_size(3, model, sample, device="cpu")
    assert sum(by_time) == sum(by_size) == len(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    reference(x).sum().backward()
    pipe = Pipe(model, by_size, devices=["cpu"] * 3, chunks=2)
    pipe(x).sum().backward()  # type: ignore[union-attr]
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_popped_skip_is_profiled_without_the_stashing_layers_graph() -> None:
    seen: list[Tensor] = []

    @skippable(pop=["skip"])
    class Look(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            skip = yield pop("skip")
            seen.append(skip)
            return x + skip

    @skippable(stash=["skip"])
    class SaveDoubled(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield stash("skip", x * 2)  # has a MulBackward0 history in the stashing layer
            return x

    model = nn.Sequential(nn.Linear(4, 4), SaveDoubled(), nn.Linear(4, 4), Look())
    balance_by_size(2, model, torch.randn(2, 4), device="cpu")
    assert seen and seen[-1].grad_fn is not None
    assert seen[-1].grad_fn.name() == "CloneBackward0"  # a fresh leaf's clone, not Linear's graph


def test_one_balance_error_class() -> None:
    assert BalanceErrorFromBalance is BalanceError
