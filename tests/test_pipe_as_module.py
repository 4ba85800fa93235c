"""A Pipe as an nn.Module: what is set on it after it was built, and hooks on the Pipe itself.

Its partitions run the layers they were built with, and ``step`` and
``evaluate`` run them without the Pipe's own forward: a layer set on the
Pipe afterwards, or a hook registered on it, would be ignored there, so
both are refused before any work.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import Pipe
from tests.helpers import mlp


def batch() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)


def calls(pipe: Pipe) -> dict[str, Callable[[], object]]:
    x, y = batch()
    return {
        "pipe(x)": lambda: pipe(x),
        "step": lambda: pipe.step(x, y, F.mse_loss),
        "evaluate": lambda: pipe.evaluate(x),
    }


def replace_layer(pipe: Pipe) -> None:
    setattr(pipe, "2", nn.Linear(8, 8).double())


def add_layer(pipe: Pipe) -> None:
    pipe.add_module("extra", nn.Linear(8, 8).double())


def remove_layer(pipe: Pipe) -> None:
    delattr(pipe, "5")


@pytest.mark.parametrize("change", [replace_layer, add_layer, remove_layer])
@pytest.mark.parametrize("call", ["pipe(x)", "step", "evaluate"])
def test_a_layer_set_on_the_pipe_after_it_was_built_is_refused_before_any_work(
    change: Callable[[Pipe], None], call: str
) -> None:
    # Replaced, it showed in state_dict() and named_parameters() while the partitions
    # ran the old layer (outputs 0.93 off), and an optimizer trained the unused one.
    pipe = Pipe(mlp(), [3, 3], devices=["cpu"] * 2, chunks=2)
    ran = [part.state_dict() for part in pipe.partitions]
    before = [{k: v.clone() for k, v in state.items()} for state in ran]
    change(pipe)
    with pytest.raises(RuntimeError, match=r"changed after it was built .* build a new Pipe"):
        calls(pipe)[call]()
    assert all(p.grad is None for part in pipe.partitions for p in part.parameters())
    for state, kept in zip(ran, before, strict=True):
        assert all(torch.equal(state[k], v) for k, v in kept.items())


def test_a_pipe_whose_layers_change_in_place_or_in_dtype_still_runs() -> None:
    pipe = Pipe(mlp(), [3, 3], devices=["cpu"] * 2, chunks=2)
    with torch.no_grad():
        pipe[0].weight.mul_(2)
    pipe.float().double()
    for run in calls(pipe).values():
        run()


@pytest.mark.parametrize("call", ["step", "evaluate"])
def test_hooks_on_the_pipe_itself_are_refused_by_step_and_evaluate(call: str) -> None:
    # step and evaluate never call the Pipe's forward: a hook tripling the output ran in
    # pipe(x) only, and step's loss was 0.077 against the plain model's 0.695.
    model = mlp()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [3, 3], devices=["cpu"] * 2, chunks=2)
    handle = pipe.register_forward_hook(lambda module, args, output: output * 3)
    with pytest.raises(ValueError, match=rf"forward hooks .* Pipe\.{call} runs its layers"):
        calls(pipe)[call]()
    assert all(p.grad is None for p in pipe.parameters())
    x, _ = batch()
    torch.testing.assert_close(pipe(x), 3 * plain(x))  # pipe(x) runs them
    handle.remove()
    calls(pipe)[call]()


class Held(nn.Module):
    """Holds its first call until released: a call under way on another thread."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()

    def forward(self, x: Tensor) -> Tensor:
        self.started.set()
        assert self.release.wait(60)
        return x


def test_close_from_another_thread_lets_the_call_under_way_end_then_refuses_calls() -> None:
    # The call under way handed its next tasks to stopped workers and never returned.
    held = Held()
    pipe = Pipe(nn.Sequential(nn.Linear(8, 8), held, nn.Linear(8, 8)).double(), [2, 1],
                devices=["cpu"] * 2, chunks=2)  # fmt: skip
    x, _ = batch()
    outcome: list[object] = []
    call = threading.Thread(target=lambda: outcome.append(pipe(x)))
    call.start()
    assert held.started.wait(60)
    closing = threading.Thread(target=pipe.close)
    closing.start()
    held.release.set()
    call.join(60)
    closing.join(60)
    assert not call.is_alive() and not closing.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], Tensor)
    with pytest.raises(RuntimeError, match="this Pipe is closed"):
        pipe(x)


class Closes(nn.Module):
    """Closes the pipe it is a layer of, from the worker running it."""

    def __init__(self) -> None:
        super().__init__()
        self.pipes: list[Pipe] = []  # a list: a module attribute would register the pipe

    def forward(self, x: Tensor) -> Tensor:
        for pipe in self.pipes:
            pipe.close()
        return x


@pytest.mark.parametrize("engine", ["call", "step"])
def test_close_from_the_pipes_own_worker_is_refused_not_a_hang(engine: str) -> None:
    # The call waited for the worker, which waited for the call to end: both hung.
    closes = Closes()
    pipe = Pipe(nn.Sequential(nn.Linear(8, 8), closes).double(), [1, 1], devices=["cpu"] * 2,
                chunks=2)  # fmt: skip
    closes.pipes.append(pipe)
    x, y = batch()
    run = (lambda: pipe(x)) if engine == "call" else (lambda: pipe.step(x, y, F.mse_loss))
    with pytest.raises(RuntimeError, match="on one of the pipe's own worker threads"):
        run()
    closes.pipes.clear()
    pipe.close()
    with pytest.raises(RuntimeError, match="this Pipe is closed"):
        pipe(x)
