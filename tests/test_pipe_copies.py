"""Copies of a Pipe (finding F12): deepcopy, pickle and torch.save give an independent Pipe.

A copy has its own parameters and its own worker threads; closing or training
one of the two leaves the other as it was. A shallow copy shares the layers
but still gets workers of its own. Partition backward hooks stay with the
Pipe they were registered on.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable, Generator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.skip import Namespace, pop, skippable, stash
from tests.conftest import pipe_threads
from tests.helpers import assert_close_dicts, grads, mlp


def deep_copied(pipe: Pipe) -> Pipe:
    return copy.deepcopy(pipe)


def pickled(pipe: Pipe) -> Pipe:
    return pickle.loads(pickle.dumps(pipe))  # type: ignore[no-any-return]


def saved_and_loaded(pipe: Pipe) -> Pipe:
    buffer = io.BytesIO()
    torch.save(pipe, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # type: ignore[no-any-return]


COPIES: dict[str, Callable[[Pipe], Pipe]] = {
    "deepcopy": deep_copied,
    "pickle": pickled,
    "torch_save": saved_and_loaded,
}
copy_methods = pytest.mark.parametrize("make_copy", list(COPIES.values()), ids=list(COPIES))


def x_rows(n: int = 7) -> Tensor:
    return torch.randn(n, 8, dtype=torch.float64)


def new_pipe(**kwargs: Any) -> Pipe:
    return Pipe(mlp(), [2, 2, 2], devices=["cpu"] * 3, chunks=4, **kwargs)


def train_step(pipe: Pipe, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    pipe.zero_grad()
    out = pipe(x)
    assert isinstance(out, Tensor)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), grads(pipe)


@copy_methods
def test_copy_gives_equal_outputs_and_gradients(make_copy: Callable[[Pipe], Pipe]) -> None:
    pipe = new_pipe()
    twin = make_copy(pipe)
    assert (twin.balance, twin.chunks, twin.checkpoint) == (pipe.balance, 4, "except_last")
    x = x_rows()
    out, g = train_step(pipe, x)
    twin_out, twin_g = train_step(twin, x)
    torch.testing.assert_close(twin_out, out)
    assert_close_dicts(twin_g, g)


@copy_methods
def test_copy_has_its_own_parameters(make_copy: Callable[[Pipe], Pipe]) -> None:
    pipe = new_pipe()
    twin = make_copy(pipe)
    x = x_rows()
    before = pipe(x).detach()
    for (name, p), (twin_name, q) in zip(
        pipe.named_parameters(), twin.named_parameters(), strict=True
    ):
        assert name == twin_name and p is not q and p.data_ptr() != q.data_ptr()
    # The partitions the copy runs hold the copy's registered layers, not the original's.
    assert all(a is b for a, b in zip(twin, twin.children(), strict=True))
    assert not any(a is b for a, b in zip(pipe, twin, strict=True))
    with torch.no_grad():
        dict(twin.named_parameters())["0.weight"].add_(1.0)
    torch.testing.assert_close(pipe(x), before)
    assert not torch.allclose(twin(x), before)
    with torch.no_grad():
        dict(pipe.named_parameters())["4.bias"].add_(1.0)
    assert not torch.equal(pipe.state_dict()["4.bias"], twin.state_dict()["4.bias"])


@copy_methods
def test_copy_has_its_own_worker_threads(make_copy: Callable[[Pipe], Pipe]) -> None:
    pipe = new_pipe()
    threads_of_original = set(pipe_threads())
    twin = make_copy(pipe)
    threads_of_twin = set(pipe_threads()) - threads_of_original
    assert len(threads_of_original) == 3 and len(threads_of_twin) == 3
    x = x_rows()
    expected = pipe(x).detach()
    twin.close()
    assert all(not t.is_alive() for t in threads_of_twin)
    assert all(t.is_alive() for t in threads_of_original)
    torch.testing.assert_close(pipe(x), expected)
    with pytest.raises(RuntimeError, match="this Pipe is closed"):
        twin(x)


@copy_methods
def test_closing_the_original_leaves_the_copy_working(make_copy: Callable[[Pipe], Pipe]) -> None:
    pipe = new_pipe()
    twin = make_copy(pipe)
    x = x_rows()
    expected = pipe(x).detach()
    pipe.close()
    with pytest.raises(RuntimeError, match="this Pipe is closed"):
        pipe(x)
    torch.testing.assert_close(twin(x), expected)
    twin.close()


@copy_methods
def test_training_the_copy_leaves_the_original_gradients_untouched(
    make_copy: Callable[[Pipe], Pipe],
) -> None:
    pipe = new_pipe()
    x = x_rows()
    _, original_grads = train_step(pipe, x)
    twin = make_copy(pipe)
    train_step(twin, torch.randn_like(x))
    torch.optim.SGD(twin.parameters(), lr=0.5).step()
    assert_close_dicts(grads(pipe), original_grads)
    _, again = train_step(pipe, x)
    assert_close_dicts(again, original_grads)


@copy_methods
def test_copy_of_a_pipe_with_deferred_batch_norm_keeps_its_own_statistics(
    make_copy: Callable[[Pipe], Pipe],
) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.BatchNorm1d(8))
    pipe = Pipe(model.double(), [2, 2], devices=["cpu"] * 2, chunks=4, deferred_batch_norm=True)
    twin = make_copy(pipe)
    initial = {k: v.clone() for k, v in pipe.state_dict().items()}
    x = x_rows(8)
    twin_out, twin_g = train_step(twin, x)
    # Training the copy updated the copy's statistics only.
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, initial[key]), key
    assert not torch.equal(twin.state_dict()["1.running_mean"], initial["1.running_mean"])
    out, g = train_step(pipe, x)
    torch.testing.assert_close(twin_out, out)
    assert_close_dicts(twin_g, g)
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(twin.state_dict()[key], value, msg=key)


@skippable(stash=["skip"])
class StashProjection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("skip", torch.tanh(self.side(x)))
        return x * 2


@skippable(pop=["skip"])
class PopAndAdd(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip: Tensor = yield pop("skip")
        return x + skip


@copy_methods
@pytest.mark.parametrize("namespace", ["default", "isolated"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_copy_of_a_pipe_with_skip_connections_trains_like_the_original(
    make_copy: Callable[[Pipe], Pipe], namespace: str, checkpoint: str
) -> None:
    stasher: Any = StashProjection()
    popper: Any = PopAndAdd()
    if namespace == "isolated":
        level = Namespace("level")
        stasher, popper = stasher.isolate(level), popper.isolate(level)
    model = nn.Sequential(nn.Linear(8, 8), stasher, nn.Linear(8, 8), popper, nn.Linear(8, 8))
    pipe = Pipe(model.double(), [2, 1, 2], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    twin = make_copy(pipe)
    try:
        x = x_rows()
        out, g = train_step(pipe, x)
        twin_out, twin_g = train_step(twin, x)
        torch.testing.assert_close(twin_out, out)
        assert_close_dicts(twin_g, g)
        assert pipe.state_dict()["1.side.weight"].data_ptr() != (
            twin.state_dict()["1.side.weight"].data_ptr()
        )
    finally:  # a failure here must not leave the workers to the leak check's timeouts
        pipe.close()
        twin.close()


def test_shallow_copy_shares_layers_but_has_its_own_workers() -> None:
    pipe = new_pipe()
    threads_of_original = set(pipe_threads())
    shallow = copy.copy(pipe)
    assert all(a is b for a, b in zip(pipe, shallow, strict=True))
    x = x_rows()
    torch.testing.assert_close(shallow(x), pipe(x))
    shallow.close()
    assert all(t.is_alive() for t in threads_of_original)
    pipe(x).sum().backward()  # the original still runs forward and backward
    with pytest.raises(RuntimeError, match="this Pipe is closed"):
        shallow(x)


def test_closing_the_original_leaves_a_shallow_copy_working() -> None:
    pipe = new_pipe()
    shallow = copy.copy(pipe)
    x = x_rows()
    expected = pipe(x).detach()
    pipe.close()
    torch.testing.assert_close(shallow(x), expected)
    shallow.close()


@pytest.mark.parametrize(
    "make_copy",
    [*COPIES.values(), copy.copy],
    ids=[*COPIES, "shallow_copy"],
)
def test_partition_backward_hooks_are_not_carried_to_a_copy(
    make_copy: Callable[[Pipe], Pipe],
) -> None:
    pipe = new_pipe()
    calls: list[int] = []
    pipe.register_partition_backward_hook(calls.append)
    twin = make_copy(pipe)
    x = x_rows().requires_grad_()
    twin(x).sum().backward()
    assert calls == []
    pipe(x).sum().backward()
    assert sorted(calls) == [0, 1, 2]
