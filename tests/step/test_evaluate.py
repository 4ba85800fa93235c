"""Pipe.evaluate: the plain model in eval() under no_grad, the pipe left as it was found."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from step_models import WIDTH, block, layered
from torch import Tensor, nn

import pipeline
from pipeline import Pipe
from pipeline.step.actions import Action
from pipeline.step.runner import forward_programs
from pipeline.step.simulate import validate
from tests.helpers import Rendezvous


class Noise(nn.Module):
    """Draws in eval mode too: adds uniform noise whatever its mode."""

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.rand_like(x)


def model_with_state() -> nn.Sequential:
    """BatchNorm (running statistics), dropout (off in eval), and a skip across partitions."""
    torch.manual_seed(3)
    skipping, _ = layered(2, "first to last")
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        nn.BatchNorm1d(WIDTH),
        nn.Dropout(0.5),
        *skipping,
    ).double()


def batch(rows: int = 7) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(rows, WIDTH, generator=gen, dtype=torch.double)
    return x, torch.randn(rows, WIDTH, generator=gen, dtype=torch.double)


@pytest.mark.parametrize("threads", ["partition", "device"])
def test_evaluate_equals_the_plain_model_in_eval(threads: str) -> None:
    # threads="device": one thread runs the three stages' forwards, grad off.
    model = model_with_state()
    plain = copy.deepcopy(model).eval()
    pipe = Pipe(model, [3, 2, 2], devices=["cpu"] * 3, chunks=3, threads=threads)  # type: ignore[arg-type]
    x, y = batch()
    with torch.no_grad():
        output = plain(x)
    expected = F.mse_loss(output, y)

    torch.testing.assert_close(pipe.evaluate(x), output, rtol=0, atol=1e-15)
    torch.testing.assert_close(pipe.evaluate(x, y, F.mse_loss), expected)
    loss, outputs = pipe.evaluate(x, y, nn.MSELoss(reduction="sum"), return_outputs=True)
    torch.testing.assert_close(loss, F.mse_loss(output, y, reduction="sum"))
    torch.testing.assert_close(outputs, output, rtol=0, atol=1e-15)
    assert not outputs.requires_grad and not loss.requires_grad


def test_evaluate_leaves_grads_statistics_modes_and_generators() -> None:
    model = nn.Sequential(*model_with_state(), Noise())
    pipe = Pipe(model, [4, 2, 2], devices=["cpu"] * 3, chunks=3)
    x, y = batch(rows=8)  # 3, 3, 2: no micro-batch of one row for BatchNorm in training
    pipe.step(x, y, F.mse_loss)
    pipe[1].eval()  # a BatchNorm the user froze: mixed modes
    modes = [m.training for m in pipe.modules()]
    grads = [p.grad for p in pipe.parameters()]
    values = [g.clone() for g in grads if g is not None]
    buffers = {k: v.clone() for k, v in pipe.state_dict().items()}
    generator = torch.get_rng_state()

    report = pipe.last_step
    pipe.evaluate(x, y, F.mse_loss, return_outputs=True)

    assert pipe.last_step is report  # what the last step ran
    assert [m.training for m in pipe.modules()] == modes
    assert [p.grad for p in pipe.parameters()] == grads  # the same tensors
    for before, after in zip(values, [g for g in grads if g is not None], strict=True):
        assert torch.equal(before, after)
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, buffers[name]), name
    assert torch.equal(torch.get_rng_state(), generator)


@pytest.mark.parametrize("threads", ["partition", "device"])
def test_evaluate_draws_fresh_and_reproducibly(threads: str) -> None:
    # "device": the thread owns the CPU generator and draws with no seeding mode.
    def draws() -> list[Tensor]:
        torch.manual_seed(11)
        model = nn.Sequential(block(), Noise(), block())
        pipe = Pipe(model, [2, 1], devices=["cpu"] * 2, threads=threads)  # type: ignore[arg-type]
        x = torch.zeros(4, WIDTH)
        return [pipe.evaluate(x) for _ in range(2)]

    first, second = draws()
    assert not torch.equal(first, second)  # fresh numbers on each call
    again = draws()
    assert torch.equal(first, again[0]) and torch.equal(second, again[1])


def test_micro_batches_overlap_across_partitions() -> None:
    # Partition 0's second micro-batch and partition 1's first must run at
    # once: a barrier both wait at breaks (and the evaluation fails) otherwise.
    barrier = threading.Barrier(2, timeout=30)
    model = nn.Sequential(Rendezvous(barrier, call=2), Rendezvous(barrier, call=1))
    pipe = Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=2)
    with pipeline.trace() as t:
        pipe.evaluate(torch.zeros(2, 1))
        output = pipe.evaluate(torch.zeros(2, 1))
    torch.testing.assert_close(output, torch.full((2, 1), 2.0))
    forwards = [(e.step, e.partition, e.microbatch) for e in t.events if e.kind == "forward"]
    assert sorted(forwards) == [(s, j, i) for s in (0, 1) for j in (0, 1) for i in (0, 1)]


def test_forward_programs_run_every_forward_once_without_deadlock() -> None:
    for m, stages, workers in [(3, 2, 2), (4, 4, 2), (1, 3, 3), (2, 6, 3)]:
        programs = forward_programs(m, stages, workers)
        actions = sorted(a for program in programs for a in program)
        assert actions == sorted(Action(s, "F", i) for s in range(stages) for i in range(m))
        # Played with the backwards appended in reverse (validate needs them), they end.
        backward = [
            [*p, *(Action(a.stage, "B", a.microbatch) for a in reversed(p))] for p in programs
        ]
        validate(backward, m, stages)


def test_evaluate_refuses_loss_arguments_that_do_not_fit() -> None:
    pipe = Pipe(nn.Sequential(block(), block()), [1, 1], devices=["cpu"] * 2)
    x, y = torch.zeros(2, WIDTH), torch.zeros(2, WIDTH)
    with pytest.raises(TypeError, match="got a target but no loss_fn"):
        pipe.evaluate(x, y)
    with pytest.raises(TypeError, match="got a loss_fn but no target"):
        pipe.evaluate(x, None, F.mse_loss)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="got loss_reduction but no loss_fn"):
        pipe.evaluate(x, loss_reduction="sum")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="reduction='none'"):
        pipe.evaluate(x, y, nn.MSELoss(reduction="none"))
    with pytest.raises(ValueError, match="target splits into micro-batches"):
        pipe.evaluate(x, y[:1], F.mse_loss)
    pipe.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.evaluate(x)


def test_step_under_no_grad_points_to_evaluate() -> None:
    pipe = Pipe(nn.Sequential(block(), block()), [1, 1], devices=["cpu"] * 2)
    x = torch.zeros(2, WIDTH)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"pipe\.evaluate\(x\)"):
        pipe.step(x, x, F.mse_loss)
    with torch.inference_mode():
        torch.testing.assert_close(pipe.evaluate(x), pipe(x))
