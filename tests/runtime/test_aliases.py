"""A partition returning tensors that share memory, and the next one writing into one of them.

In the plain model the write shows in each; between partitions each travels
on its own. Such a write is refused in every engine, before the backward;
reading them is the plain model's, exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe


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
    with pytest.raises(RuntimeError, match="starts with a layer that writes into its input"):
        runs(pipe_model, chunks, checkpoint)[engine]()
    assert all(p.grad is None for p in pipe_model.parameters())


@pytest.mark.parametrize("first", [Twice, ViewBeside])
@pytest.mark.parametrize("engine", ["pipe(x)", "evaluate"])
@pytest.mark.parametrize(("chunks", "checkpoint"), [(2, "never"), (2, "always")])
def test_an_undeclared_write_into_tensors_sharing_memory_is_refused_before_the_backward(
    first: type[nn.Module], engine: str, chunks: int, checkpoint: str
) -> None:
    # pipe(x) gave the plain model's outputs but gradients 3.8 (7.6 for a view) off.
    # (In step the write is into a leaf of the stage's graph, which torch refuses.)
    pipe_model = model(first, WritesOne)
    with pytest.raises(RuntimeError, match="wrote in place into its input's leaf 0"):
        runs(pipe_model, chunks, checkpoint)[engine]()
    assert all(p.grad is None for p in pipe_model.parameters())


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
