"""What the caller enters around a Pipe call that its worker threads would not see is refused."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from pipeline import Pipe


def model(norm: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    middle = nn.BatchNorm1d(4) if norm else nn.Identity()
    return nn.Sequential(nn.Linear(4, 4), middle, nn.Tanh(), nn.Linear(4, 4)).double()


def pipe_of(layers: nn.Sequential, checkpoint: str = "always") -> Pipe:
    return Pipe(layers, [2, 2], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)


X = torch.randn(6, 4, dtype=torch.double)
Y = torch.randn(6, 4, dtype=torch.double)


def under_grad(pipe: Pipe) -> Any:
    # With one chunk it gave a gradient of zeros; with two, torch's error after
    # the first partition had moved BatchNorm's statistics.
    return torch.func.grad(lambda x: pipe(x).sum())(X)


def under_vmap(pipe: Pipe) -> Any:
    return torch.func.vmap(pipe)(X.unsqueeze(1))


def under_forward_ad(pipe: Pipe) -> Any:
    with forward_ad.dual_level():
        return pipe(forward_ad.make_dual(X, torch.ones_like(X)))


def under_mode(mode: Callable[[], AbstractContextManager[Any]]) -> Callable[[Pipe], Any]:
    def call(pipe: Pipe) -> Any:
        with mode():
            return pipe(X)

    return call


def step_under(mode: Callable[[], AbstractContextManager[Any]]) -> Callable[[Pipe], Any]:
    def call(pipe: Pipe) -> Any:
        with mode():
            return pipe.step(X, Y, F.mse_loss)

    return call


def compressed() -> AbstractContextManager[Any]:
    """A hook that changes what is saved (activation compression)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.half(), lambda t: t.double())


class CountLinear(torch.overrides.TorchFunctionMode):
    """A user's function mode: it counts F.linear, and could change its values."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def evaluate_under(mode: Callable[[], AbstractContextManager[Any]]) -> Callable[[Pipe], Any]:
    def call(pipe: Pipe) -> Any:
        with mode():
            return pipe.evaluate(X, Y, F.mse_loss)

    return call


CALLS = {
    "torch.func.grad": (under_grad, "torch.func transform"),
    "torch.func.vmap": (under_vmap, "torch.func transform"),
    "forward AD": (under_forward_ad, "forward-mode AD level"),
    "FlopCounterMode": (under_mode(lambda: FlopCounterMode(display=False)), "dispatch mode"),
    "save_on_cpu": (under_mode(torch.autograd.graph.save_on_cpu), "saved-tensor hooks"),
    "compression hooks, step": (step_under(compressed), "saved-tensor hooks"),
    "FlopCounterMode, step": (step_under(lambda: FlopCounterMode(display=False)), "dispatch mode"),
    # The workers ran without it: it saw none of the partitions' calls, silently.
    "a function mode": (under_mode(CountLinear), "torch function mode"),
    "a function mode, step": (step_under(CountLinear), "torch function mode"),
    "a function mode, evaluate": (evaluate_under(CountLinear), "torch function mode"),
}


def test_torch_device_as_a_context_is_no_function_mode_to_refuse() -> None:
    pipe = pipe_of(model())
    with torch.device("cpu"):
        pipe(X).sum().backward()
    assert all(p.grad is not None for p in pipe.parameters())


@pytest.mark.parametrize("name", list(CALLS))
def test_a_transform_mode_or_hook_the_workers_would_miss_is_refused_before_any_work(
    name: str,
) -> None:
    call, found = CALLS[name]
    pipe = pipe_of(model())
    with pytest.raises(RuntimeError, match=f"do not see the {found}"):
        call(pipe)
    bn = pipe[1]
    assert isinstance(bn, nn.BatchNorm1d) and int(bn.num_batches_tracked) == 0
    assert all(p.grad is None for p in pipe.parameters())
    # Outside them, the same pipe runs.
    pipe(X).sum().backward()


def test_functional_call_recomputing_is_refused_and_without_recomputation_equals_plain() -> None:
    # The recomputation ran in the backward, after functional_call had put the
    # module's own weights back: gradients 1.2 to 2.5 off, silently.
    plain = model(norm=False)
    params = {name: p.detach() * 1.5 for name, p in plain.named_parameters()}
    weights = {name: value.clone().requires_grad_() for name, value in params.items()}
    torch.func.functional_call(plain, weights, (X,)).square().sum().backward()
    for checkpoint in ("always", "except_last"):
        refused = {name: value.clone().requires_grad_() for name, value in params.items()}
        with pytest.raises(RuntimeError, match=r"torch\.func\.functional_call"):
            torch.func.functional_call(pipe_of(model(False), checkpoint), refused, (X,))
    given = {name: value.clone().requires_grad_() for name, value in params.items()}
    out = torch.func.functional_call(pipe_of(model(False), "never"), given, (X,))
    assert isinstance(out, Tensor)
    out.square().sum().backward()
    for name, value in given.items():
        torch.testing.assert_close(value.grad, weights[name].grad, msg=name)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("given", ["parameters", "buffers"])
def test_functional_call_of_parameters_or_buffers_is_refused_by_the_recomputation(
    checkpoint: str, given: str
) -> None:
    # Only plain tensors were refused: another model's Parameters, or a buffer alone,
    # passed, and the recomputation used the module's own (gradients 1.1 to 10 off).
    layers = model(norm=False)
    layers[1] = Scaled()
    pipe = pipe_of(layers, checkpoint)
    if given == "parameters":
        values: dict[str, Tensor] = dict(model(norm=False).named_parameters())
        values = {n: nn.Parameter(v.detach() * 1.5) for n, v in values.items()}
    else:
        values = {"1.scale": torch.full((4,), 3.0, dtype=torch.double)}
    out = torch.func.functional_call(pipe, values, (X,))
    assert isinstance(out, Tensor)
    with pytest.raises(RuntimeError, match=r"not the tensor its forward used"):
        out.square().sum().backward()


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4, dtype=torch.double))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def parametrized() -> nn.Sequential:
    layers = model(norm=False)
    nn.utils.parametrizations.spectral_norm(layers[0])
    return layers


@pytest.mark.parametrize(
    ("call", "checkpoint"),
    [("step", "never"), ("step", "always"), ("pipe(x)", "always"), ("pipe(x)", "except_last")],
)
def test_a_step_or_recomputing_call_under_cached_parametrizations_is_refused_before_any_work(
    call: str, checkpoint: str
) -> None:
    # One cached weight for every micro-batch: torch's "backward through the graph a
    # second time", or a CheckpointError, after .grad and spectral norm's vectors moved.
    pipe = pipe_of(parametrized(), checkpoint)
    vectors = pipe.get_buffer("0.parametrizations.weight.0._u").clone()
    run = {"step": lambda: pipe.step(X, Y, F.mse_loss), "pipe(x)": lambda: pipe(X)}[call]
    with (
        nn.utils.parametrize.cached(),
        pytest.raises(RuntimeError, match=r"parametrize\.cached\(\)"),
    ):
        run()
    assert all(p.grad is None for p in pipe.parameters())
    torch.testing.assert_close(pipe.get_buffer("0.parametrizations.weight.0._u"), vectors)


def test_cached_parametrizations_pass_where_nothing_is_shared_between_backwards() -> None:
    plain, layers = parametrized(), parametrized()
    pipe = pipe_of(layers, "never")
    with nn.utils.parametrize.cached():
        expected = plain(X)
        got = pipe(X)
        evaluated = pipe.evaluate(X)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(evaluated, plain.eval()(X))
