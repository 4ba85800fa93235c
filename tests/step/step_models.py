"""Models, schedules and comparisons shared by the tests of ``Pipe.step``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.schedules import GPipe, Interleaved1F1B, OneFOneB, ZeroBubbleH1
from pipeline.skip import Namespace
from tests.helpers import Pop, Stash

WIDTH = 4
MODES = ("always", "except_last", "never")
SCHEDULES: dict[str, Callable[[], Any]] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved": lambda: Interleaved1F1B(virtual=2),
    "zb-h1": ZeroBubbleH1,
    "zb-h1 peak": lambda: ZeroBubbleH1(memory="peak"),
}


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


def layered(n: int, layout: str) -> tuple[nn.Sequential, list[int]]:
    """n partitions of 2 layers each, with the skips of ``layout`` placed in them."""
    layers = [block() for _ in range(2 * n)]
    pairs: list[tuple[int, int]] = {
        "none": [],
        "within a partition": [(0, 1)],
        "adjacent": [(1, 2)] if n > 1 else [(0, 1)],
        "first to last": [(0, 2 * n - 1)],
        "two namespaces": [(0, 2 * n - 1), (1, 2 * n - 2)] if n > 1 else [(0, 1)],
    }[layout]
    for stash_at, pop_at in pairs:
        ns = Namespace()
        layers[stash_at] = nn.Sequential(Stash(WIDTH).isolate(ns), layers[stash_at])
        layers[pop_at] = nn.Sequential(layers[pop_at], Pop(WIDTH).isolate(ns))
    return nn.Sequential(*layers).double(), [2] * n


LAYOUTS = ["none", "within a partition", "adjacent", "first to last", "two namespaces"]


def chunk_counts(n: int) -> list[int]:
    return sorted({1, max(n - 1, 1), n, 2 * n + 1})


def grads(module: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def assert_same(actual: list[Tensor | None], expected: list[Tensor | None], what: str) -> None:
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert (a is None) == (e is None), f"{what}: parameter {k} gradient presence"
        if a is not None and e is not None:
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=f"{what}: parameter {k}")
