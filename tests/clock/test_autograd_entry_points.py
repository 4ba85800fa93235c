"""Every autograd entry point through a Pipe gives what it gives on the plain nn.Sequential.

``torch.autograd.grad`` with respect to parameters or inputs, ``create_graph``
(gradient penalties, grad of grad), ``backward(inputs=...)`` and
``backward(retain_graph=True)`` twice, in every checkpoint mode.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Generator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from pipeline.skip import pop, skippable, stash
from tests.helpers import cpu_pipe, mlp

MODES = ["always", "except_last", "never"]
ROWS = 7  # not divisible by 3 or 4: the last micro-batch is smaller
WIDTH = 8
SPLITS = [
    pytest.param([3, 3], 1, id="2-partitions-1-chunk"),
    pytest.param([3, 3], 3, id="2-partitions-3-chunks"),
    pytest.param([2, 2, 2], 3, id="3-partitions-3-chunks"),
    pytest.param([2, 2, 2], 4, id="3-partitions-4-chunks"),
]

Results = dict[str, Tensor | None]


@skippable(stash=["s"])
class Stash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash("s", torch.tanh(self.linear(x)))
        return x * 2


@skippable(pop=["s"])
class Pop(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        s: Tensor = yield pop("s")
        return x + s


def skip_mlp() -> nn.Sequential:
    """Six layers; the skip crosses one boundary with balance [3, 3] and two with [2, 2, 2]."""
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        Stash(),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        Pop(),
        nn.Linear(WIDTH, WIDTH),
    ).double()


def dropout_mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Dropout(0.3),
        nn.Linear(WIDTH, WIDTH),
        nn.Dropout(0.3),
        nn.Tanh(),
    ).double()


MODELS: dict[str, Callable[[], nn.Sequential]] = {"mlp": mlp, "skip-across-partitions": skip_mlp}


def loss_of(out: Tensor) -> Tensor:
    """A loss whose gradient and second derivative differ from row to row."""
    weights = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype).view_as(out)
    return (weights * out).square().sum()


def dot_grads(model: nn.Module) -> Results:
    """Every parameter's ``.grad``, None included."""
    return {f"{name}.grad": p.grad for name, p in model.named_parameters()}


def assert_no_grad_written(model: nn.Module) -> None:
    written = [name for name, p in model.named_parameters() if p.grad is not None]
    assert written == [], f"torch.autograd.grad wrote .grad of {written}"


def leaf(x: Tensor) -> Tensor:
    return x.detach().clone().requires_grad_()


# Each entry point runs one kind of backward on a model and returns what it
# computed together with every parameter's .grad afterwards.


def grad_wrt_parameters(model: nn.Module, x: Tensor) -> Results:
    names, params = zip(*model.named_parameters(), strict=True)
    got = torch.autograd.grad(loss_of(model(x)), list(params))
    assert_no_grad_written(model)
    return {**{f"d loss/d {n}": g for n, g in zip(names, got, strict=True)}, **dot_grads(model)}


def grad_wrt_input_only(model: nn.Module, x: Tensor) -> Results:
    x = leaf(x)
    (gx,) = torch.autograd.grad(loss_of(model(x)), x)
    assert_no_grad_written(model)
    return {"d loss/d input": gx, **dot_grads(model)}


def gradient_penalty_step(model: nn.Module, x: Tensor) -> Results:
    x = leaf(x)
    out = model(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = (gx.norm(dim=1) - 1).square().mean()
    (loss_of(out) + penalty).backward()
    return {"penalty": penalty.detach(), "input.grad": x.grad, **dot_grads(model)}


def grad_of_grad(model: nn.Module, x: Tensor) -> Results:
    x = leaf(x)
    (gx,) = torch.autograd.grad(loss_of(model(x)), x, create_graph=True)
    gx.square().sum().backward()
    return {"d loss/d input": gx.detach(), "input.grad": x.grad, **dot_grads(model)}


def backward_inputs_first_and_last(model: nn.Module, x: Tensor) -> Results:
    params = list(model.parameters())
    loss_of(model(x)).backward(inputs=[params[0], params[-1]])
    filled = [p for p in params if p.grad is not None]
    assert len(filled) == 2 and filled[0] is params[0] and filled[1] is params[-1]
    return dot_grads(model)


def backward_twice_retaining_the_graph(model: nn.Module, x: Tensor) -> Results:
    x = leaf(x)
    loss = loss_of(model(x))
    loss.backward(retain_graph=True)
    once = {f"once {k}": None if v is None else v.clone() for k, v in dot_grads(model).items()}
    loss.backward()
    return {**once, "input.grad": x.grad, **dot_grads(model)}


ENTRY_POINTS = [
    grad_wrt_parameters,
    grad_wrt_input_only,
    gradient_penalty_step,
    grad_of_grad,
    backward_inputs_first_and_last,
    backward_twice_retaining_the_graph,
]


def assert_same_results(actual: Results, expected: Results) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if value is None:
            assert actual[key] is None, f"{key} should be None"
        else:
            assert actual[key] is not None, f"{key} is None"
            torch.testing.assert_close(actual[key], value, msg=key)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize(("balance", "chunks"), SPLITS)
@pytest.mark.parametrize("checkpoint", MODES)
def test_entry_point_equals_the_plain_model(
    entry_point: Callable[[nn.Module, Tensor], Results],
    model_name: str,
    balance: list[int],
    chunks: int,
    checkpoint: str,
) -> None:
    model = MODELS[model_name]()
    x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    expected = entry_point(copy.deepcopy(model), x)
    actual = entry_point(cpu_pipe(model, balance, chunks, checkpoint), x)
    assert_same_results(actual, expected)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("checkpoint", MODES)
def test_entry_point_on_one_thread_for_every_partition_equals_the_plain_model(
    entry_point: Callable[[nn.Module, Tensor], Results], model_name: str, checkpoint: str
) -> None:
    # The clock cycles, fences included, run on that thread.
    model = MODELS[model_name]()
    x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    expected = entry_point(copy.deepcopy(model), x)
    actual = entry_point(cpu_pipe(model, [2, 2, 2], 4, checkpoint, threads="device"), x)
    assert_same_results(actual, expected)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(("balance", "chunks"), SPLITS[1:3])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_entry_point_with_dropout_equals_the_pipe_without_checkpointing(
    entry_point: Callable[[nn.Module, Tensor], Results],
    balance: list[int],
    chunks: int,
    checkpoint: str,
) -> None:
    # Masks differ from the plain model's, but a Pipe draws the same ones
    # whatever its checkpoint mode, and recomputation replays them.
    model = dropout_mlp()
    x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    torch.manual_seed(1)
    expected = entry_point(cpu_pipe(copy.deepcopy(model), balance, chunks, "never"), x)
    torch.manual_seed(1)
    actual = entry_point(cpu_pipe(model, balance, chunks, checkpoint), x)
    assert_same_results(actual, expected)


class MaskedBlock(nn.Module):
    """Takes and returns (mask, hidden); a loss on hidden alone gives mask no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, inp: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        mask, h = inp
        return mask, torch.tanh(self.linear(h))


@pytest.mark.parametrize("mask_requires_grad", [False, True], ids=["constant-mask", "grad-mask"])
@pytest.mark.parametrize(("balance", "chunks"), SPLITS)
@pytest.mark.parametrize("checkpoint", MODES)
def test_first_float_output_without_gradient_equals_the_plain_model(
    mask_requires_grad: bool, balance: list[int], chunks: int, checkpoint: str
) -> None:
    model = nn.Sequential(*(MaskedBlock() for _ in range(6))).double()
    x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    mask = torch.ones(ROWS, WIDTH, dtype=torch.float64)

    def run(m: nn.Module) -> Results:
        h, mask_in = leaf(x), mask.clone().requires_grad_(mask_requires_grad)
        mask_out, out = m((mask_in, h))
        loss_of(out).backward()
        return {"out": out.detach(), "mask out": mask_out.detach(), "input.grad": h.grad,
                "mask.grad": mask_in.grad, **dot_grads(m)}  # fmt: skip

    expected = run(copy.deepcopy(model))
    assert_same_results(run(cpu_pipe(model, balance, chunks, checkpoint)), expected)


class IndexedBlock(nn.Module):
    """Passes a bool mask it computes and integer ids it shifts to the next layer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.embedding = nn.Embedding(5, WIDTH)

    def forward(self, inp: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        h, keep, ids = inp
        h = torch.tanh(self.linear(h)).masked_fill(~keep, 0.0) + self.embedding(ids)
        return h, h > -0.25, (ids + 1) % 5


@pytest.mark.parametrize(("balance", "chunks"), SPLITS)
@pytest.mark.parametrize("checkpoint", MODES)
def test_bool_and_integer_tensors_crossing_partitions_equal_the_plain_model(
    balance: list[int], chunks: int, checkpoint: str
) -> None:
    model = nn.Sequential(*(IndexedBlock() for _ in range(6))).double()
    x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    keep = torch.rand(ROWS, WIDTH) > 0.3
    ids = torch.randint(0, 5, (ROWS,))

    def run(m: nn.Module) -> Results:
        h = leaf(x)
        out, keep_out, ids_out = m((h, keep, ids))
        assert keep_out.dtype == torch.bool and ids_out.dtype == torch.int64
        loss_of(out).backward()
        return {"out": out.detach(), "keep": keep_out, "ids": ids_out, "input.grad": h.grad,
                **dot_grads(m)}  # fmt: skip

    expected = run(copy.deepcopy(model))
    assert_same_results(run(cpu_pipe(model, balance, chunks, checkpoint)), expected)


def outcome(run: Callable[[], Tensor]) -> tuple[str, Any]:
    try:
        return "returned", run()
    except RuntimeError as e:
        return "raised", (type(e), str(e))


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_inference_tensor_input_to_a_checkpointed_pipe_raises_torchs_error(
    checkpoint: str,
) -> None:
    pipe = cpu_pipe(mlp(), [3, 3], 3, checkpoint)
    with torch.inference_mode():
        x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        loss_of(pipe(x)).backward()


@pytest.mark.parametrize(("balance", "chunks"), SPLITS)
def test_inference_tensor_input_without_checkpointing_behaves_as_the_plain_model(
    balance: list[int], chunks: int
) -> None:
    model = mlp()
    with torch.inference_mode():
        x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    expected = outcome(lambda: copy.deepcopy(model)(x))
    actual = outcome(lambda: cpu_pipe(model, balance, chunks, "never")(x))
    assert actual[0] == expected[0]
    if expected[0] == "returned":
        torch.testing.assert_close(actual[1], expected[1])
    else:
        assert actual[1] == expected[1]


@pytest.mark.parametrize("mode", MODES)
def test_parameters_changed_before_backward_are_refused_as_by_the_plain_model(mode: str) -> None:
    # An optimizer step between the forward and backward(): the plain model's
    # backward refuses the saved weight; a recomputed micro-batch used the new one.
    pipe = cpu_pipe(mlp(WIDTH), [3, 3], chunks=2, checkpoint=mode)
    out = pipe(torch.randn(ROWS, WIDTH, dtype=torch.double))
    with torch.no_grad():
        for param in pipe.parameters():
            param.mul_(1.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.square().sum().backward()
