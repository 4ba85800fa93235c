"""Compiled layers stay compiled inside a Pipe, and give the plain model's gradients.

Compiling is slow here, so the models are tiny and ``aot_eager`` (dynamo and
AOTAutograd, no code generation) tells most of the story; one test runs
inductor. The layers are compiled in place (``layer.compile()``), the recipe
that keeps the plain model's ``state_dict`` keys.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import Pipe
from pipeline.runtime import rng
from tests.helpers import grads

dynamo = pytest.importorskip("torch._dynamo")

MODES = ("always", "never")  # except_last checkpoints a subset of always's tasks
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(torch.tanh(self.linear(x)), self.dropout, self.training)


class Residual(Block):
    """A block whose compiled backward keeps a buffer that is not an output (``tanh``'s)."""

    def forward(self, x: Tensor) -> Tensor:
        return x + super().forward(x)


def blocks(dropout: float = 0.0, kind: type[Block] = Block) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(kind(dropout) for _ in range(4))).double()


def compiled(model: nn.Sequential, backend: str = "aot_eager") -> nn.Sequential:
    for layer in model:
        layer.compile(backend=backend)
    return model


def frames() -> int:
    return int(dynamo.utils.counters["frames"]["ok"])


X = torch.randn(8, 8, dtype=torch.double)
Y = torch.randn(8, 8, dtype=torch.double)


@pytest.mark.parametrize("balance", [[4], [2, 2]], ids=["owned generator", "seeded draws"])
def test_compiled_layers_compile_and_give_the_plain_models_gradients(balance: list[int]) -> None:
    plain = blocks()
    F.mse_loss(plain(X), Y).backward()
    dynamo.reset()
    pipe = Pipe(compiled(blocks()), balance, devices=["cpu"] * len(balance), chunks=2)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    runs = {"pipe(x)": lambda: F.mse_loss(pipe(X), Y).backward()}
    # Every schedule where stages seed their draws; the owned path runs one stage.
    for schedule in SCHEDULES if len(balance) == 2 else ("zb-h1",):
        runs[schedule] = lambda s=schedule: pipe.step(X, Y, F.mse_loss, schedule=s)
    before = frames()
    for what, run in runs.items():
        pipe.zero_grad()
        run()
        for name, grad in grads(pipe).items():
            torch.testing.assert_close(grad, dict(plain.named_parameters())[name].grad, msg=what)
    assert frames() > before


@pytest.mark.parametrize("balance", [[4], [2, 2]], ids=["owned generator", "seeded draws"])
def test_compiled_dropout_is_replayed_exactly_when_checkpointed(balance: list[int]) -> None:
    dynamo.reset()
    pipes = {
        mode: Pipe(
            compiled(blocks(0.5)),
            balance,
            devices=["cpu"] * len(balance),
            chunks=2,
            checkpoint=mode,  # type: ignore[arg-type]
        )
        for mode in MODES
    }
    before = frames()
    for schedule in ("pipe(x)", "zb-h1"):
        results = {}
        for mode, pipe in pipes.items():
            pipe.zero_grad()
            torch.manual_seed(5)
            if schedule == "pipe(x)":
                F.mse_loss(pipe(X), Y).backward()
            else:
                pipe.step(X, Y, F.mse_loss, schedule=schedule)
            results[mode] = grads(pipe)
        for name, grad in results["never"].items():
            assert torch.equal(results["always"][name], grad), (schedule, name)
    assert frames() > before


def test_inductor_draws_its_seeds_through_the_seeding_mode() -> None:
    dynamo.reset()
    results = {}
    for mode in ("never", "always"):
        pipe = Pipe(
            compiled(blocks(0.5), backend="inductor"),
            [2, 2],
            devices=["cpu"] * 2,
            chunks=2,
            checkpoint=mode,  # type: ignore[arg-type]
        )
        torch.manual_seed(6)
        F.mse_loss(pipe(X), Y).backward()
        results[mode] = grads(pipe)
    assert frames() > 0
    for name, grad in results["never"].items():
        assert torch.equal(results["always"][name], grad), name


def test_inductor_compiled_layers_give_the_plain_models_gradients_in_zb_h1() -> None:
    # Found on an H200 and then here: inductor's compiled backward reuses the
    # buffers it saved, so running it in I and again in W gave other weight
    # gradients, with no error (aot_eager, above, did not show it).
    plain = blocks(kind=Residual)
    F.mse_loss(plain(X), Y).backward()
    dynamo.reset()
    pipe = Pipe(
        compiled(blocks(kind=Residual), backend="inductor"), [2, 2], devices=["cpu"] * 2, chunks=2
    )
    pipe.step(X, Y, F.mse_loss, schedule="zb-h1")
    assert frames() > 0
    for name, grad in grads(pipe).items():
        torch.testing.assert_close(grad, dict(plain.named_parameters())[name].grad, msg=name)


def test_a_compiled_layer_in_a_seeded_partition_is_refused_before_torch_2_9(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rng, "MODE_COMPILES", False)
    shared = Pipe(compiled(blocks()), [2, 2], devices=["cpu"] * 2)
    with pytest.raises(RuntimeError, match=r"partition 0 holds a compiled layer.*torch >= 2\.9"):
        shared(X)
    alone = Pipe(copy.deepcopy(blocks()), [4], devices=["cpu"])
    alone[0].compile(backend="aot_eager")
    assert alone(X).shape == X.shape  # type: ignore[union-attr]
