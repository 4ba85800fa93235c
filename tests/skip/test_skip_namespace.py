"""Namespaces let one skippable class serve many places in a model."""

from __future__ import annotations

import copy
from collections.abc import Generator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.skip import Namespace, pop, skippable, stash, verify_skippables


@skippable(stash=["skip"])
class Keep(nn.Module):
    """Stashes its input and passes it on scaled."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("skip", x)
        return x * self.scale


@skippable(pop=["skip"])
class Add(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return x + skip


def nested_blocks() -> nn.Sequential:
    """(x*2 -> (y*3 -> + y) -> + x): the inner block must pop its own skip."""
    outer, inner = Namespace("outer"), Namespace("inner")
    return nn.Sequential(
        Keep(2).isolate(outer),
        Keep(3).isolate(inner),
        Add().isolate(inner),
        Add().isolate(outer),
    )


def test_isolated_blocks_pop_their_own_skip() -> None:
    x = torch.tensor([[1.0]])
    # inner: y = 2x, 3y + y = 8x; outer: 8x + x = 9x
    torch.testing.assert_close(nested_blocks()(x), 9 * x)
    pipe = Pipe(nested_blocks(), [1, 1, 1, 1], devices=["cpu", "cpu:0", "cpu", "cpu:0"])
    torch.testing.assert_close(pipe(x), 9 * x)


def test_repeated_blocks_without_namespaces_are_refused() -> None:
    model = nn.Sequential(Keep(2), Keep(3), Add(), Add())
    with pytest.raises(TypeError, match=r"'skip' \(default\) stashed by both layer '0' \(Keep\)"):
        verify_skippables(model)


def test_isolate_only_moves_the_names_given() -> None:
    @skippable(stash=["a", "b"])
    class Two(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield stash("a", x)
            yield stash("b", x)
            return x

    ns = Namespace()
    layer = Two().isolate(ns, only=["a"])
    assert layer.namespaced("a") == (ns, "a")
    assert layer.namespaced("b")[0] is not ns
    assert layer.isolate(ns) is layer
    assert layer.namespaced("b") == (ns, "b")


def test_isolate_refuses_unknown_names_and_non_namespaces() -> None:
    with pytest.raises(ValueError, match=r"Keep .* cannot isolate \['nope'\]: it declares only"):
        Keep(1).isolate(Namespace(), only=["nope"])
    with pytest.raises(TypeError, match="isolate\\(\\) takes a Namespace, got str"):
        Keep(1).isolate("outer")


def test_namespaces_are_distinct_by_identity_and_survive_copies() -> None:
    a, b = Namespace("same"), Namespace("same")
    assert a != b
    assert copy.deepcopy(a) is a
    model = copy.deepcopy(nested_blocks())
    verify_skippables(model)
    torch.testing.assert_close(model(torch.ones(1, 1)), torch.full((1, 1), 9.0))
    assert repr(a) == "Namespace('same')"
    assert Namespace().label.startswith("#")


def test_a_layer_may_isolate_itself_in_its_constructor() -> None:
    @skippable(pop=["skip"])
    class Level(nn.Module):
        def __init__(self, ns: Namespace) -> None:
            super().__init__()
            self.isolate(ns)

        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            skip = yield pop("skip")
            return x - skip

    ns = Namespace()
    model = nn.Sequential(Keep(5).isolate(ns), Level(ns))
    torch.testing.assert_close(model(torch.ones(1, 1)), torch.full((1, 1), 4.0))
