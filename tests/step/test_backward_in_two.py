"""The input/weight gradient split equals one backward, in the cases torch's own split got wrong."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.step.backward_in_two import backward_input
from tests.helpers import grads


class WeightTwiceOnThePath(nn.Module):
    """One layer applied twice in a row: its weight is reached from two anchors (torch #180952)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(torch.tanh(self.linear(x)))


class MultiOutputNode(nn.Module):
    """chunk() is one node with two outputs, both on the path (torch #170277)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.linear(x).chunk(2, dim=1)
        return torch.cat([a * b.sigmoid(), b], dim=1)


class OutputOffTheInputPath(nn.Module):
    """A second output that depends on a weight only, not on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(8))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.linear(x), self.scale * 2


class ViewOutput(nn.Module):
    """The output is a view of an intermediate (torch #142229)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x).view(-1, 2, 4)


class TiedLayers(nn.Module):
    """Two layers sharing one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.relu(self.a(x)))


class OutputWithoutGradient(nn.Module):
    """A second output that needs no gradient (torch #182182): a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = self.linear(x)
        return y, (y > 0).float().detach()


class AroundAnotherGroup(nn.Module):
    """A weight reached from two anchors, with another group's anchor on the path between.

    As T5's relative position bias, computed once and used by every block:
    W from the upper anchor walks down the input path, through the norm.
    """

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(8))
        self.norm = nn.LayerNorm(8)

    def forward(self, x: Tensor) -> Tensor:
        bias = self.table * 2
        return self.norm(x * bias) * bias


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
    "block": lambda: nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
    "transformer layer": lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0),
    "weight used twice on the path": WeightTwiceOnThePath,
    "multi-output node": MultiOutputNode,
    "output off the input path": OutputOffTheInputPath,
    "view as output": ViewOutput,
    "tied weights": TiedLayers,
    "output without gradient": OutputWithoutGradient,
    "weight reached around another group": AroundAnotherGroup,
}


def outputs_of(module: nn.Module, x: Tensor) -> list[Tensor]:
    out = module(x)
    return [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]


@pytest.mark.parametrize("summed", [True, False], ids=["summed", "into .grad"])
@pytest.mark.parametrize("input_requires_grad", [True, False], ids=["input grad", "no input grad"])
@pytest.mark.parametrize("name", list(MODELS))
def test_input_then_weight_gradients_equal_one_backward(
    name: str, input_requires_grad: bool, summed: bool
) -> None:
    torch.manual_seed(0)
    module = MODELS[name]().double()
    x = torch.randn(4, 8, dtype=torch.double, requires_grad=input_requires_grad)
    params = list(module.parameters())
    outputs = outputs_of(module, x)
    grads = [torch.randn_like(o) for o in outputs]
    wanted = params + ([x] if input_requires_grad else [])
    expected = torch.autograd.grad(outputs, wanted, grads, allow_unused=True)

    outputs = outputs_of(module, x)
    halves = backward_input(outputs, grads, [x])
    assert halves is not None
    input_grads, work = halves
    weights, weight_grads = work.run(lambda _: summed)
    if summed:
        assert all(p.grad is None for p in params), "summed: I and W leave .grad to the stage"
        by_weight = {id(w): g for w, g in zip(weights, weight_grads, strict=True)}
    else:
        assert weights == [], "nothing to sum: W accumulated into .grad"
        by_weight = {id(p): p.grad for p in params if p.grad is not None}
    assert set(by_weight) <= {id(p) for p in params}
    for p, e in zip(params, expected[: len(params)], strict=True):
        found = by_weight.get(id(p))
        if e is None:
            assert found is None
        else:
            assert found is not None
            torch.testing.assert_close(found, e, rtol=0, atol=1e-12)
    if input_requires_grad:
        torch.testing.assert_close(input_grads[0], expected[-1], rtol=0, atol=1e-12)
    else:
        assert input_grads == [None]


def test_a_scalar_loss_needs_no_gradient_and_unused_inputs_get_none() -> None:
    module = nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    unused = torch.randn(2, dtype=torch.double, requires_grad=True)
    loss = module(x).square().sum()
    halves = backward_input([loss], [None], [x, unused])
    assert halves is not None
    grads, work = halves
    weights, weight_grads = work.run(lambda _: True)
    reference = nn.Linear(4, 4).double()
    reference.load_state_dict(module.state_dict())
    xr = x.detach().requires_grad_()
    reference(xr).square().sum().backward()
    torch.testing.assert_close(grads[0], xr.grad)
    assert grads[1] is None
    found = dict(zip(map(id, weights), weight_grads, strict=True))
    torch.testing.assert_close(found[id(module.weight)], reference.weight.grad)


class ConsumingLinear(torch.autograd.Function):
    """``x @ w.T`` whose backward reuses the buffer it kept, as inductor's compiled backward may.

    A second run of its backward returns other numbers, with no error: the
    buffer is kept outside ``save_for_backward``, so no version check sees it.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.x, ctx.w = x.detach().clone(), w.detach()
        return x @ w.T

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        gx, gw = g @ ctx.w, g.T @ ctx.x
        ctx.x.zero_()
        return gx, gw


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(ConsumingLinear.apply(x, self.weight))


def test_a_python_function_computing_weight_gradients_is_not_split() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    out = Fused()(x)
    assert backward_input([out], [torch.ones_like(out)], [x]) is None


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_zb_h1_runs_such_a_functions_backward_once_and_gives_the_plain_models_gradients(
    checkpoint: str,
) -> None:
    # Found on a GPU, then on the CPU: zb-h1 over layers compiled by inductor
    # (CompiledFunctionBackward) gave other weight gradients, silently.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), Fused(), nn.Linear(8, 8), Fused()).double()
    x, y = torch.randn(8, 8, dtype=torch.double), torch.randn(8, 8, dtype=torch.double)
    F.mse_loss(plain(x), y).backward()
    pipe = Pipe(copy.deepcopy(plain), [2, 2], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)  # type: ignore[arg-type]
    pipe.zero_grad()
    pipe.step(x, y, F.mse_loss, schedule="zb-h1")
    for name, grad in grads(pipe).items():
        torch.testing.assert_close(grad, dict(plain.named_parameters())[name].grad, msg=name)
