"""Small models and comparisons shared by the tests."""

from __future__ import annotations

import threading
from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.skip import pop, skippable, stash
from pipeline.step.actions import Program
from pipeline.trace.event import Kind, task_name


def mlp(width: int = 8, depth: int = 6, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    layers: list[nn.Module] = []
    for k in range(depth):
        layers.append(nn.Linear(width, width) if k % 2 == 0 else nn.Tanh())
    return nn.Sequential(*layers).to(dtype)


def grads(module: nn.Module) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def assert_close_dicts(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=name)


def cpu_pipe(
    model: nn.Sequential, balance: list[int], chunks: int, checkpoint: str, **options: Any
) -> Pipe:
    """A Pipe of ``model`` with every partition on the CPU."""
    return Pipe(
        model,
        balance,
        devices=["cpu"] * len(balance),
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        **options,
    )


_TASK_KINDS: dict[str, Kind] = {
    "F": "forward",
    "B": "backward",
    "I": "input_grad",
    "W": "weight_grad",
}


def task_names(program: Program) -> set[str]:
    """The names of a program's actions in traces and profiles (``pipe.forward[mb=0,part=1]``)."""
    return {task_name(_TASK_KINDS[a.kind], a.microbatch, a.stage) for a in program}


@skippable(stash=["skip"])
class Stash(nn.Module):
    """Stashes a function of its input as "skip"; passes on twice the input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("skip", torch.tanh(self.linear(x)))
        return x * 2


@skippable(pop=["skip"])
class Pop(nn.Module):
    """Pops "skip" and multiplies its own output by it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop("skip")
        return self.linear(x) * skip


class Rendezvous(nn.Module):
    """Waits at a barrier on its ``call``-th call: both partitions must be inside at once."""

    def __init__(self, barrier: threading.Barrier, call: int) -> None:
        super().__init__()
        self.barrier = barrier
        self.call = call
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.call:
            self.barrier.wait()  # raises BrokenBarrierError after the timeout
        return x + 1


@skippable(stash=["shared"])
class StashesWhatItReturns(nn.Module):
    """Stashes its input as "shared" and returns it: one memory on two paths."""

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("shared", x)
        return x


class WritesItsInput(nn.Module):
    """Doubles its input in place (no ``inplace`` attribute: the Pipe hands it no copy)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2)


@skippable(pop=["shared"])
class AddsShared(nn.Module):
    """Pops "shared" and adds it; with ``write``, triples the popped tensor in place first."""

    def __init__(self, write: bool = False) -> None:
        super().__init__()
        self.write = write

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        shared = yield pop("shared")
        if self.write:
            shared.mul_(3)
        return x + shared


def shared_skip_model(writes: str, width: int = 8) -> nn.Sequential:
    """A frozen layer, a skip stashed as what it returns, then a write into one of the two
    (``writes``: "main", "pop" or "none"); the plain model's pop and main path see it."""
    torch.manual_seed(0)
    writer = WritesItsInput() if writes == "main" else nn.Identity()
    layers = [
        nn.Linear(width, width),
        StashesWhatItReturns(),
        nn.Identity(),
        writer,
        AddsShared(write=writes == "pop"),
        nn.Linear(width, width),
    ]
    model = nn.Sequential(*layers).double()
    model[0].requires_grad_(False)  # the shared tensor needs no gradient: a write is allowed
    return model
