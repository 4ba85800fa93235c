"""Keyword arguments into pipe(x), Pipe.step and balance: split like the input, to layer 0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from balance import BalanceError, balance_by_size, balance_by_time
from pipeline import NoChunk, Pipe, PositionalSequential
from tests.helpers import assert_close_dicts, grads


class Masked(nn.Module):
    """A first layer with keyword arguments; it records what each call received."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls: list[tuple[int, int | None, float, str]] = []

    def forward(
        self, x: Tensor, mask: Tensor | None = None, scale: float = 1.0, note: str = ""
    ) -> Tensor:
        self.calls.append((x.size(0), None if mask is None else mask.size(0), scale, note))
        h = self.linear(x) * scale
        return h if mask is None else h * mask.unsqueeze(-1)


def model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(Masked(), nn.Tanh(), nn.Linear(4, 4), nn.Tanh()).double()


def plain(module: nn.Sequential, *args: object, **kwargs: object) -> Tensor:
    first, *rest = module
    value = first(*args, **kwargs)
    for layer in rest:
        value = layer(value)
    return value


def rows(count: int) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(count)
    x = torch.randn(count, 4, generator=gen, dtype=torch.double)
    mask = (torch.rand(count, generator=gen) > 0.3).double()
    return x, mask, torch.randn(count, 4, generator=gen, dtype=torch.double)


def test_keyword_tensors_are_split_and_other_keywords_reach_every_micro_batch() -> None:
    pipe = Pipe(model(), [1, 3], devices=["cpu"] * 2, chunks=3, checkpoint="never")
    reference = model()
    x, mask, target = rows(5)
    out = pipe(x, mask=mask, scale=0.5, note="every")
    expected = plain(reference, x, mask=mask, scale=0.5, note="every")
    torch.testing.assert_close(out, expected)
    F.mse_loss(out, target).backward()
    F.mse_loss(expected, target).backward()
    assert_close_dicts(grads(pipe), grads(reference))
    # 5 rows in 3 chunks: 2, 2 and 1, the mask split alike, the others whole.
    assert pipe[0].calls == [(2, 2, 0.5, "every"), (2, 2, 0.5, "every"), (1, 1, 0.5, "every")]
    pipe.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_step_takes_the_first_layers_keywords(schedule: str, checkpoint: str) -> None:
    pipe = Pipe(model(), [2, 2], devices=["cpu"] * 2, chunks=3, checkpoint=checkpoint)
    reference = model()
    x, mask, target = rows(7)
    loss = pipe.step(x, target, F.mse_loss, kwargs={"mask": mask, "scale": 2.0}, schedule=schedule)
    expected = F.mse_loss(plain(reference, x, mask=mask, scale=2.0), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    assert_close_dicts(grads(pipe), grads(reference))
    assert {call[1:3] for call in pipe[0].calls} == {(3, 2.0), (1, 2.0)}
    pipe.close()


def test_evaluate_takes_the_first_layers_keywords() -> None:
    pipe = Pipe(model(), [2, 2], devices=["cpu"] * 2, chunks=3)
    reference = model().eval()
    x, mask, target = rows(5)
    with torch.no_grad():
        expected = plain(reference, x, mask=mask, scale=3.0)
    kwargs = {"mask": mask, "scale": 3.0}
    torch.testing.assert_close(pipe.evaluate(x, kwargs=kwargs), expected)
    loss = pipe.evaluate(x, target, F.mse_loss, kwargs=kwargs)
    torch.testing.assert_close(loss, F.mse_loss(expected, target))
    assert {call[1:3] for call in pipe[0].calls} == {(2, 3.0), (1, 3.0)}
    with pytest.raises(ValueError, match=r"input\['mask'\]: 2 rows in 2"):
        pipe.evaluate(x, kwargs={"mask": mask[:2]})
    pipe.close()


def test_keywords_alone_and_a_keyword_shared_whole() -> None:
    pipe, reference = Pipe(model(), [3, 1], devices=["cpu"] * 2, chunks=2), model()
    x, mask, target = rows(4)
    whole = torch.ones(2, dtype=torch.double)  # 2 entries for every micro-batch of 2 rows
    out = pipe(x=x, mask=NoChunk(whole))
    halves = [plain(reference, x=half, mask=whole) for half in x.split(2)]
    torch.testing.assert_close(out, torch.cat(halves))
    reference.zero_grad()
    loss = pipe.step(None, target, F.mse_loss, kwargs={"x": x, "mask": mask})
    expected = F.mse_loss(plain(reference, x=x, mask=mask), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    pipe.close()


def test_a_keyword_tensor_splitting_into_other_micro_batches_is_refused_before_any_work() -> None:
    # Each tensor is split on its own (Tensor.chunk), keywords too: 4 rows in 4 chunks
    # give 4 micro-batches, 3 rows only 3.
    pipe = Pipe(model(), [2, 2], devices=["cpu"] * 2, chunks=4)
    x, mask, target = rows(4)
    message = r"split into different numbers of micro-batches.*input\['mask'\]: 3 rows in 3"
    with pytest.raises(ValueError, match=message):
        pipe(x, mask=mask[:3])
    with pytest.raises(ValueError, match=message):
        pipe.step(x, target, F.mse_loss, kwargs={"mask": mask[:3]})
    assert pipe[0].calls == []
    pipe.close()


def test_what_a_call_with_keywords_cannot_be() -> None:
    pipe = Pipe(model(), [2, 2], devices=["cpu"] * 2)
    x, mask, target = rows(2)
    with pytest.raises(TypeError, match=r"Pipe\.forward takes one input, got 2"):
        pipe(x, mask, scale=2.0)
    with pytest.raises(TypeError, match="kwargs must be a dict of the first layer's keyword"):
        pipe.step(x, target, F.mse_loss, kwargs=[("mask", mask)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"keyword argument names must be strings, got \[1\]"):
        pipe.step(x, target, F.mse_loss, kwargs={1: mask})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="holds no tensor to split"):
        pipe(note="no tensor")
    assert pipe[0].calls == []
    pipe.close()


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.ones(2))

    def forward(self, a: Tensor, b: Tensor, *, weight: Tensor) -> tuple[Tensor, Tensor]:
        return a * weight + self.bias, b + weight


class Add(nn.Module):
    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return a + b


def test_positional_call_style_gives_keywords_to_the_first_layer() -> None:
    sequential = PositionalSequential(Pair(), Add(), nn.Tanh())
    pipe = Pipe(sequential, [2, 1], devices=["cpu"] * 2, chunks=2, call_style="positional")
    a, b, weight = torch.randn(3, 2), torch.randn(3, 2), torch.randn(3, 2)
    expected = sequential(a, b, weight=weight)
    torch.testing.assert_close(pipe(a, b, weight=weight), expected)
    loss = pipe.step((a, b), torch.zeros(3, 2), F.mse_loss, kwargs={"weight": weight})
    expected_loss = F.mse_loss(expected, torch.zeros(3, 2))
    torch.testing.assert_close(loss, expected_loss)
    (gradient,) = torch.autograd.grad(expected_loss, sequential[0].bias)
    torch.testing.assert_close(sequential[0].bias.grad, gradient)
    pipe.close()


class NeedsMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor, *, mask: Tensor) -> Tensor:
        return self.linear(x) * mask.unsqueeze(-1)


def test_balance_profiles_the_first_layer_with_its_keywords() -> None:
    module = nn.Sequential(NeedsMask(), nn.Tanh(), nn.Linear(4, 4))
    x, mask = torch.randn(3, 4), torch.ones(3)
    timed = balance_by_time(2, module, x, kwargs={"mask": mask}, timeout=0.01, device="cpu")
    sized = balance_by_size(2, module, None, kwargs={"x": x, "mask": mask}, device="cpu")
    assert sum(timed) == sum(sized) == 3
    failed = r"layer 0 \(NeedsMask\) failed on input \(float32\[3, 4\], mask=float32\[2\]\)"
    with pytest.raises(BalanceError, match=failed):
        balance_by_time(2, module, x, kwargs={"mask": mask[:2]}, device="cpu")
    with pytest.raises(BalanceError, match=r"keyword argument 'mask' is empty"):
        balance_by_size(2, module, x, kwargs={"mask": torch.ones(0)}, device="cpu")
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        balance_by_time(2, module, x, kwargs=mask, device="cpu")  # type: ignore[arg-type]
