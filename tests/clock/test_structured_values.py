"""Structured values (tuples, lists, dicts, namedtuples, return types) through a Pipe.

Every tensor nested in a value is split along dim 0 like a top-level one, each
container keeps its type between partitions and at the output, and outputs and
gradients equal those of the plain model (findings F8, F10, F13).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from pipeline import NoChunk, Pipe, PositionalSequential
from pipeline.arguments import CheckpointMode
from tests.helpers import assert_close_dicts, grads

WIDTH = 8
MODES: list[CheckpointMode] = ["always", "except_last", "never"]


def rows(n: int = 7, width: int = WIDTH) -> Tensor:
    """A float64 batch; 7 rows make uneven micro-batches (2, 2, 2, 1) with chunks=4."""
    return torch.randn(n, width, dtype=torch.float64)


def weighted_sum(value: Any) -> Tensor:
    """A loss that reaches every floating leaf with a different weight per element."""
    leaves = [x for x in tree_flatten(value)[0] if isinstance(x, Tensor) and x.is_floating_point()]
    return sum(
        ((x * torch.linspace(-1, 2, x.numel(), dtype=x.dtype).view_as(x)).sum() for x in leaves),
        torch.zeros((), dtype=torch.float64),
    )


def fresh_leaves(value: Any, requires_grad: bool = True) -> Any:
    """A copy of ``value`` whose floating tensors are new leaves (requiring grad if asked)."""

    def leaf(x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        x = x.detach().clone()
        return x.requires_grad_() if requires_grad and x.is_floating_point() else x

    return tree_map(leaf, value)


def input_grads(value: Any) -> list[Tensor | None]:
    return [x.grad for x in tree_flatten(value)[0] if isinstance(x, Tensor)]


def assert_same_value(actual: Any, expected: Any) -> None:
    """Same structure (container types included) and close tensors at every leaf."""
    actual_leaves, actual_spec = tree_flatten(actual)
    expected_leaves, expected_spec = tree_flatten(expected)
    assert actual_spec == expected_spec, f"structure {actual_spec} != {expected_spec}"
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        if isinstance(e, Tensor):
            torch.testing.assert_close(a, e)
        else:
            assert a == e


def assert_pipe_equals_plain(
    model: nn.Sequential,
    balance: list[int],
    value: Any,
    checkpoint: CheckpointMode,
    *,
    chunks: int = 4,
    loss: Callable[[Any], Tensor] = weighted_sum,
    requires_grad: bool = True,
) -> None:
    """The Pipe's output, parameter gradients and input gradients equal the plain model's."""
    reference = copy.deepcopy(model)
    expected_input = fresh_leaves(value, requires_grad)
    expected = reference(expected_input)
    loss(expected).backward()

    pipe = Pipe(
        model, balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint
    )
    actual_input = fresh_leaves(value, requires_grad)
    try:
        actual = pipe(actual_input)
        loss(actual).backward()
    finally:  # a failure must not leave the workers to the leak check's timeouts
        pipe.close()

    assert_same_value(actual, expected)
    assert_close_dicts(grads(pipe), grads(reference))
    for a, e in zip(input_grads(actual_input), input_grads(expected_input), strict=True):
        if e is None:
            assert a is None or not a.any(), "an input the loss does not reach got a gradient"
        else:
            assert a is not None, "an input of the plain model got a gradient, the Pipe's not"
            torch.testing.assert_close(a, e)


# F8: a (mask, hidden) tuple between partitions; the loss uses hidden only.


class MaskedBlock(nn.Module):
    def __init__(self, use_mask: bool) -> None:
        super().__init__()
        self.use_mask = use_mask
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, inp: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        mask, h = inp
        h = torch.tanh(self.linear(h))
        return mask, h * mask if self.use_mask else h


def hidden_only(out: tuple[Tensor, Tensor]) -> Tensor:
    return weighted_sum(out[1])


@pytest.mark.parametrize("balance", [[2, 2], [1, 2, 1]])
@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("checkpoint", MODES)
def test_mask_and_hidden_tuple_trains_when_the_loss_uses_hidden_only(
    balance: list[int], use_mask: bool, requires_grad: bool, checkpoint: CheckpointMode
) -> None:
    # The mask, the first floating tensor of the tuple, gets no gradient from the output.
    model = nn.Sequential(*(MaskedBlock(use_mask) for _ in range(4))).double()
    value = ((torch.rand(7, WIDTH) > 0.3).double(), rows())
    assert_pipe_equals_plain(
        model, balance, value, checkpoint, loss=hidden_only, requires_grad=requires_grad
    )


# F10: per-sample tensors nested one and two levels deep in the input tuple.


def unwrap(nested: Any, depth: int) -> Tensor:
    for _ in range(depth):
        (nested,) = nested
    assert isinstance(nested, Tensor)
    return nested


class AddNestedBias(nn.Module):
    """Adds a per-sample bias found ``depth`` tuples deep; passes the nesting on unchanged."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, inp: tuple[Tensor, Any]) -> tuple[Tensor, Any]:
        x, nested = inp
        return torch.tanh(self.linear(x) + unwrap(nested, self.depth)), nested


class First(nn.Module):
    def forward(self, inp: tuple[Tensor, Any]) -> Tensor:
        return inp[0]


def nest(x: Tensor, depth: int) -> Any:
    value: Any = x
    for _ in range(depth):
        value = (value,)
    return value


@pytest.mark.parametrize("balance", [[1, 3], [2, 1, 1]])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("checkpoint", MODES)
def test_per_sample_tensor_nested_in_input_tuple_is_split_like_top_level_tensors(
    balance: list[int], depth: int, checkpoint: CheckpointMode
) -> None:
    model = nn.Sequential(AddNestedBias(depth), AddNestedBias(depth), AddNestedBias(depth), First())
    model = model.double()
    x, bias = rows(), rows()
    assert_pipe_equals_plain(model, balance, (x, nest(bias, depth)), checkpoint)
    pipe = Pipe(copy.deepcopy(model), balance, devices=["cpu"] * len(balance), chunks=4)
    assert pipe((x, nest(bias, depth))).shape == (7, WIDTH)


# Dicts and lists between partitions and as the Pipe's output.


class ToDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> dict[str, Any]:
        h = self.linear(x)
        return {"h": torch.tanh(h), "aux": [h * 2, h.sum(1, keepdim=True)]}


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, d: dict[str, Any]) -> dict[str, Any]:
        assert isinstance(d, dict) and isinstance(d["aux"], list), type(d)
        scaled, total = d["aux"]
        h = torch.tanh(self.linear(d["h"]) + total)
        return {"h": h, "aux": [scaled * d["h"], total + h.sum(1, keepdim=True)]}


@pytest.mark.parametrize("balance", [[1, 3], [2, 1, 1]])
@pytest.mark.parametrize("checkpoint", MODES)
def test_dicts_and_lists_pass_between_partitions_and_gather_with_their_structure(
    balance: list[int], checkpoint: CheckpointMode
) -> None:
    model = nn.Sequential(ToDict(), DictBlock(), DictBlock(), DictBlock()).double()
    assert_pipe_equals_plain(model, balance, rows(), checkpoint)


def test_dict_output_is_gathered_as_a_dict_holding_a_list() -> None:
    model = nn.Sequential(ToDict(), DictBlock()).double()
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=4)
    out = pipe(rows())
    assert type(out) is dict and list(out) == ["h", "aux"]
    assert type(out["aux"]) is list and len(out["aux"]) == 2
    assert out["h"].shape == (7, WIDTH) and out["aux"][1].shape == (7, 1)


# F13: torch.return_types and namedtuples keep their type between partitions.


class Point(NamedTuple):
    x: Tensor
    y: Tensor


class Max(nn.Module):
    def forward(self, x: Tensor) -> Any:
        return x.max(dim=1)


class FromMax(nn.Module):
    """Reads a ``torch.return_types.max``; returns a ``Point``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, WIDTH)

    def forward(self, r: Any) -> Point:
        assert isinstance(r, torch.return_types.max), type(r)
        x = torch.tanh(self.linear(r.values.unsqueeze(1)))
        return Point(x=x, y=r.indices.to(x.dtype).unsqueeze(1) * x)


class FromPoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, p: Point) -> Tensor:
        assert isinstance(p, Point), type(p)
        out: Tensor = self.linear(p.x) + p.y
        return out


@pytest.mark.parametrize("balance", [[2, 2], [3, 1], [2, 1, 1]])
@pytest.mark.parametrize("checkpoint", MODES)
def test_return_types_and_namedtuples_keep_their_type_between_partitions(
    balance: list[int], checkpoint: CheckpointMode
) -> None:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Max(), FromMax(), FromPoint()).double()
    assert_pipe_equals_plain(model, balance, rows(), checkpoint)


@pytest.mark.parametrize("checkpoint", MODES)
def test_namedtuple_output_is_gathered_as_that_namedtuple(checkpoint: CheckpointMode) -> None:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Max(), FromMax()).double()
    assert_pipe_equals_plain(model, [2, 1], rows(), checkpoint)
    pipe = Pipe(copy.deepcopy(model), [2, 1], devices=["cpu"] * 2, chunks=4)
    out = pipe(rows())
    assert type(out) is Point and out.x.shape == (7, WIDTH)


class PointToTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, p: Point) -> Tensor:
        assert isinstance(p, Point), type(p)
        return torch.tanh(self.linear(p.x)) * p.y


@pytest.mark.parametrize("checkpoint", MODES)
def test_namedtuple_as_pipe_input_reaches_the_first_layer_as_that_namedtuple(
    checkpoint: CheckpointMode,
) -> None:
    model = nn.Sequential(PointToTensor(), nn.Linear(WIDTH, WIDTH), nn.Tanh()).double()
    assert_pipe_equals_plain(model, [1, 2], Point(x=rows(), y=rows()), checkpoint)


# NoChunk nested inside a dict reaches every micro-batch whole.


class MaskedLinear(nn.Module):
    """Multiplies by a whole (WIDTH, WIDTH) matrix found in a dict; records the shapes it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, inp: tuple[Tensor, dict[str, Tensor]]) -> tuple[Tensor, dict[str, Tensor]]:
        x, extras = inp
        self.seen.append(tuple(extras["matrix"].shape))
        return torch.tanh(self.linear(x) @ extras["matrix"]), extras


@pytest.mark.parametrize("checkpoint", MODES)
def test_nochunk_nested_in_a_dict_reaches_every_micro_batch_whole(
    checkpoint: CheckpointMode,
) -> None:
    first, second = MaskedLinear(), MaskedLinear()
    model = nn.Sequential(first, second, First()).double()
    reference = copy.deepcopy(model)
    x, matrix = rows(), torch.randn(WIDTH, WIDTH, dtype=torch.float64)
    matrix_ref = matrix.clone().requires_grad_()
    expected = reference((x, {"matrix": matrix_ref}))
    weighted_sum(expected).backward()

    pipe = Pipe(model, [1, 2], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)
    matrix_pipe = matrix.clone().requires_grad_()
    actual = pipe((x, {"matrix": NoChunk(matrix_pipe)}))
    weighted_sum(actual).backward()

    assert set(first.seen) == {(WIDTH, WIDTH)} and set(second.seen) == {(WIDTH, WIDTH)}
    assert len(first.seen) >= 4 and len(second.seen) >= 4  # every micro-batch (and recomputation)
    torch.testing.assert_close(actual, expected)
    assert_close_dicts(grads(pipe), grads(reference))
    # Every micro-batch used the whole matrix: its gradient sums over all of them.
    torch.testing.assert_close(matrix_pipe.grad, matrix_ref.grad)


# call_style='positional': layers take a tuple's items as positional arguments.


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        return torch.tanh(self.linear(a) + b), a * b


@pytest.mark.parametrize("balance", [[2, 2], [1, 2, 1]])
@pytest.mark.parametrize("checkpoint", MODES)
def test_positional_call_style_equals_positional_sequential(
    balance: list[int], checkpoint: CheckpointMode
) -> None:
    model = PositionalSequential(Mix(), Mix(), Mix(), Mix()).double()
    reference = copy.deepcopy(model)
    a, b = rows(), rows()
    a_ref, b_ref = fresh_leaves((a, b))
    expected = reference(a_ref, b_ref)
    weighted_sum(expected).backward()

    pipe = Pipe(
        model,
        balance,
        devices=["cpu"] * len(balance),
        chunks=4,
        checkpoint=checkpoint,
        call_style="positional",
    )
    a_pipe, b_pipe = fresh_leaves((a, b))
    actual = pipe(a_pipe, b_pipe)
    weighted_sum(actual).backward()

    assert_same_value(actual, expected)
    assert_close_dicts(grads(pipe), grads(reference))
    torch.testing.assert_close(a_pipe.grad, a_ref.grad)
    torch.testing.assert_close(b_pipe.grad, b_ref.grad)


def test_two_inputs_in_default_call_style_raise_type_error_naming_positional() -> None:
    pipe = Pipe(nn.Sequential(Mix(), Mix()).double(), [1, 1], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(TypeError, match=r"takes one input, got 2.*call_style='positional'"):
        pipe(rows(), rows())
