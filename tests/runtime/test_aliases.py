"""A partition returning tensors that share memory, and the next one writing into one of them.

In the plain model the write shows in each; between partitions each travels
on its own. Such a write is refused in every engine, before the backward;
reading them is the plain model's, exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from pipeline import Pipe
from pipeline.runtime.aliases import sharing_groups


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.l(x) * 1.5
        return h, h


class ViewBeside(Twice):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.l(x) * 1.5
        return h, h[:, :2]


class WritesOne(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        a, b = pair
        a.mul_(2)
        return a + b[:, :1]


class WritesOneDeclared(WritesOne):
    inplace = True


class Reads(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        a, b = pair
        return 2 * a + b[:, :1]


def runs(model: nn.Sequential, chunks: int, checkpoint: str) -> dict[str, Callable[[], Tensor]]:
    """Each engine's output and a backward from it, on a pipe of ``model`` itself."""
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=chunks, checkpoint=checkpoint)  # type: ignore[arg-type]
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def call() -> Tensor:
        out = pipe(x)
        out.sum().backward()
        return out

    def step(schedule: str) -> Tensor:
        total = lambda out, target: out.sum()  # noqa: E731
        _, out = pipe.step(x, x, total, schedule=schedule, loss_reduction="sum",
                           return_outputs=True)  # fmt: skip
        return out  # type: ignore[no-any-return]

    return {
        "pipe(x)": call,
        "gpipe": lambda: step("gpipe"),
        "1f1b": lambda: step("1f1b"),
        "evaluate": lambda: pipe.evaluate(x),
    }


def model(first: type[nn.Module], second: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(first(), second()).double()


@pytest.mark.parametrize("first", [Twice, ViewBeside])
@pytest.mark.parametrize("engine", ["pipe(x)", "gpipe", "1f1b", "evaluate"])
@pytest.mark.parametrize(("chunks", "checkpoint"), [(2, "never"), (2, "always")])
def test_a_declared_write_into_tensors_sharing_memory_is_refused_before_the_backward(
    first: type[nn.Module], engine: str, chunks: int, checkpoint: str
) -> None:
    # The copy a declared in-place layer gets was made of each tensor apart: 1.17 off
    # in the outputs, 5.2 in the gradients, in every engine.
    pipe_model = model(first, WritesOneDeclared)
    with pytest.raises(RuntimeError, match="wrote in place into its input's leaves"):
        runs(pipe_model, chunks, checkpoint)[engine]()
    assert all(p.grad is None for p in pipe_model.parameters())


@pytest.mark.parametrize("first", [Twice, ViewBeside])
def test_an_undeclared_write_into_tensors_sharing_memory_is_refused_before_the_backward(
    first: type[nn.Module],
) -> None:
    # pipe(x) gave the plain model's outputs but gradients 3.8 (7.6 for a view) off: the
    # write was into one output of the pipe's autograd function between partitions.
    # (In step the write is into a leaf of the stage's graph, which torch refuses.)
    pipe_model = model(first, WritesOne)
    with pytest.raises(RuntimeError, match=r"wrote in place into its input's leaves \[0"):
        runs(pipe_model, 2, "never")["pipe(x)"]()
    assert all(p.grad is None for p in pipe_model.parameters())


class Halves(Twice):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.l(x) * 1.5
        return h[:, 2:], h[:, :2]  # one memory, no element in common


class Masks(Twice):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        mask = (x > 0).double()
        return self.l(x), mask, mask  # one tensor twice, needing no gradient


class WritesMask(nn.Module):
    def forward(self, three: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        h, mask, same = three
        mask.add_(1)
        return h * same


@pytest.mark.parametrize(
    ("first", "second", "engines"),
    [
        (Twice, WritesOne, ["evaluate"]),  # no gradient, one memory still: shows in both
        (ViewBeside, WritesOne, ["evaluate"]),
        (Halves, WritesOne, ["pipe(x)", "evaluate"]),
        (Masks, WritesMask, ["pipe(x)", "1f1b", "evaluate"]),
    ],
)
def test_writes_that_show_where_the_plain_models_do_pass(
    first: type[nn.Module], second: type[nn.Module], engines: list[str]
) -> None:
    # Refused at first: columns of one matrix, and tensors received as they were sent.
    plain = model(first, second)
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        evaluated = copy.deepcopy(plain)(x)
    expected = plain(x)
    expected.sum().backward()
    for engine in engines:
        pipe_model = copy.deepcopy(plain)
        for p in pipe_model.parameters():
            p.grad = None
        got = runs(pipe_model, 2, "never")[engine]()
        torch.testing.assert_close(got, evaluated if engine == "evaluate" else expected)
        if engine != "evaluate":
            for name, p in plain.named_parameters():
                torch.testing.assert_close(pipe_model.get_parameter(name).grad, p.grad, msg=name)


@pytest.mark.parametrize("first", [Twice, ViewBeside])
@pytest.mark.parametrize("engine", ["pipe(x)", "gpipe", "1f1b", "evaluate"])
@pytest.mark.parametrize(("chunks", "checkpoint"), [(1, "never"), (2, "never"), (2, "always")])
def test_tensors_sharing_memory_that_are_only_read_give_the_plain_models_results(
    first: type[nn.Module], engine: str, chunks: int, checkpoint: str
) -> None:
    plain = model(first, Reads)
    pipe_model = copy.deepcopy(plain)
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = plain(x)
    expected.sum().backward()
    torch.testing.assert_close(runs(pipe_model, chunks, checkpoint)[engine](), expected)
    if engine != "evaluate":
        for name, p in plain.named_parameters():
            torch.testing.assert_close(pipe_model.get_parameter(name).grad, p.grad, msg=name)


class _Wrapper(Tensor):
    """A tensor wrapping another, with no storage of its own (as a collective's result not
    waited for yet: tensor parallelism's AsyncCollectiveTensor)."""

    inner: Tensor

    @staticmethod
    def __new__(cls, inner: Tensor) -> _Wrapper:
        made = Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        made.inner = inner
        return made  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrapped(value: Any) -> Any:
            return value.inner if isinstance(value, _Wrapper) else value

        return func(*tree_map(unwrapped, args), **tree_map(unwrapped, kwargs or {}))


def test_outputs_without_storage_of_their_own_are_taken_to_share_nothing() -> None:
    # A stage ending in a tensor-parallel layer sends a tuple holding such a tensor: reading
    # its storage failed mid-step ("an invalid python storage"), and stranded the pipe.
    wrapped = _Wrapper(torch.randn(3, 4))
    plain = torch.randn(3, 4)
    assert sharing_groups((wrapped, plain, plain[:, :2])) == [frozenset({1, 2})]
