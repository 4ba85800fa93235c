"""Small float64 models and batches shared by the planner's tests."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import pipeline
from pipeline import Pipe
from pipeline.plan.result import Plan, PlanCheck
from pipeline.skip import pop, skippable, stash

ROWS, WIDTH = 32, 16


def gelu_mlp(depth: int = 6) -> nn.Sequential:
    """Linear + GELU blocks and a last Linear: no layer saves its own output."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(depth - 1)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, WIDTH)).double()


@skippable(stash=["long", "short"])
class StashesTwo(nn.Module):
    """A block that stashes two functions of its output, for far and near layers."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        h = self.linear(x)
        yield stash("long", torch.tanh(h))
        yield stash("short", h * 2)
        return F.gelu(h)


@skippable(pop=["long"])
class AddsLong(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        long = yield pop("long")
        return self.linear(x) + long


@skippable(pop=["short"])
class TimesShort(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        short = yield pop("short")
        return x * short


def skip_mlp() -> nn.Sequential:
    """``gelu_mlp`` with two skips from its first block: one to its last layer, one to its
    fourth (one saved by the popping layer, one not)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(3)]
    return nn.Sequential(StashesTwo(), blocks[0], TimesShort(), *blocks[1:], AddsLong()).double()


def batch(rows: int = ROWS) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, WIDTH, dtype=torch.double, generator=gen)
    return x, torch.randn(rows, WIDTH, dtype=torch.double, generator=gen)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread while a test profiles: on a shared 2-core machine, two threads
    contending with other jobs make each op wait milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def planned_step(
    model: nn.Sequential, schedule: str, mode: str, devices: int = 2
) -> tuple[Plan, Pipe, PlanCheck]:
    """The plan of ``model`` for one schedule and checkpoint mode on ``devices`` CPU
    partitions (4 micro-batches of ``batch()``), its pipe after one step measuring memory,
    and the plan's check of that step."""
    x, y = batch()
    plan = pipeline.plan(
        model, x, y, F.mse_loss, devices=["cpu"] * devices, batch_size=len(x),
        memory_limit=2**30, chunks=[4], schedules=[schedule], checkpoints=[mode], repeats=1,
    )  # fmt: skip
    pipe = plan.pipe()
    pipe.step(x, y, F.mse_loss, schedule=plan.schedule, measure_memory=True)
    return plan, pipe, plan.check(pipe)
