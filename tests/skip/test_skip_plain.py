"""Skippable layers outside a Pipe, and with DeferredBatchNorm inside one."""

from __future__ import annotations

import copy
import threading
from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.skip import pop, skippable, stash


@skippable(stash=["identity"])
class StashOnly(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("identity", x)
        return x


@skippable(pop=["identity"])
class PopAdd(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        identity = yield pop("identity")
        return x + identity


def residual(linear: nn.Linear) -> nn.Sequential:
    return nn.Sequential(StashOnly(), linear, PopAdd())


def test_plain_sequential_runs_a_residual_connection() -> None:
    linear = nn.Linear(3, 3)
    x = torch.randn(5, 3, requires_grad=True)
    out = residual(linear)(x)
    torch.testing.assert_close(out, linear(x) + x)
    out.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, linear.weight.sum(0).expand(5, 3) + 1)


def test_stash_only_layer_passes_its_input_through_unchanged() -> None:
    x = torch.randn(2, 3)
    model = residual(nn.Linear(3, 3))
    assert model[0](x) is x
    model[2](x)  # pops what model[0] stashed


def test_each_thread_has_its_own_tracker() -> None:
    linear = nn.Linear(3, 3)
    results: dict[int, Tensor] = {}

    def run(k: int) -> None:
        for _ in range(50):
            results[k] = residual(linear)(torch.full((1, 3), float(k)))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with torch.no_grad():
        for k, out in results.items():
            x = torch.full((1, 3), float(k))
            torch.testing.assert_close(out, linear(x) + x)


def test_deferred_batch_norm_with_skips_matches_the_plain_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        StashOnly(), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), PopAdd()
    ).double()
    plain = copy.deepcopy(model)
    x = torch.randn(12, 4, dtype=torch.double)
    pipe = Pipe(
        model,
        [2, 2, 1],
        chunks=3,
        checkpoint="always",
        deferred_batch_norm=True,
        devices=["cpu", "cpu:0", "cpu"],
    )
    out = pipe(x)
    out.sum().backward()

    # In training each micro-batch is normalised by its own statistics ...
    expected = torch.cat([plain(chunk) for chunk in x.chunk(3)])
    torch.testing.assert_close(out, expected)
    # ... while the running statistics are those of the whole mini-batch.
    whole = nn.BatchNorm1d(4).double()
    whole(plain[1](x))
    torch.testing.assert_close(pipe[2].running_mean, whole.running_mean)
    torch.testing.assert_close(pipe[2].running_var, whole.running_var)
