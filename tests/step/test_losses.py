"""How a step weighs its micro-batches' losses: the loss function's own reduction, a divisor
for means over tokens, and a GradScaler."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from step_models import SCHEDULES, WIDTH, assert_same, block, grads
from torch import Tensor, nn

from pipeline import Pipe

VOCAB = 5


def two_blocks() -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(4)
    model = nn.Sequential(block(), block(), block()).double()
    return model, copy.deepcopy(model)


def batch(rows: int = 10) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(rows, WIDTH, generator=gen, dtype=torch.double)
    return x, torch.randn(rows, WIDTH, generator=gen, dtype=torch.double)


@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.MSELoss(reduction="sum"),
        nn.MSELoss(),
        functools.partial(F.mse_loss, reduction="sum"),
        nn.KLDivLoss(reduction="batchmean", log_target=True),
    ],
    ids=["module-sum", "module-mean", "partial-sum", "kl-batchmean"],
)
def test_a_loss_function_carrying_its_reduction_gives_the_plain_models_loss(
    loss_fn: nn.Module,
) -> None:
    model, plain = two_blocks()
    x, y = batch()  # 3, 3, 3, 1 rows
    expected = loss_fn(plain(x), y)
    expected.backward()
    pipe = Pipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=4)
    torch.testing.assert_close(pipe.step(x, y, loss_fn), expected.detach())
    assert_same(grads(pipe), grads(plain), repr(loss_fn))
    torch.testing.assert_close(pipe.evaluate(x, y, loss_fn), loss_fn(plain.eval()(x), y))


def test_reductions_that_cannot_be_weighed_are_refused_before_any_work() -> None:
    model, _ = two_blocks()
    pipe = Pipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=2)
    x, y = batch(4)
    with pytest.raises(ValueError, match=r"MSELoss\) has reduction='none'.*must be a scalar"):
        pipe.step(x, y, nn.MSELoss(reduction="none"))
    with pytest.raises(ValueError, match=r"loss_reduction='mean', but loss_fn \(MSELoss\) has"):
        pipe.step(x, y, nn.MSELoss(reduction="sum"), loss_reduction="mean")
    with pytest.raises(ValueError, match="loss_reduction must be 'mean' or 'sum'"):
        pipe.step(x, y, F.mse_loss, loss_reduction="none")  # type: ignore[arg-type]
    assert all(p.grad is None for p in pipe.parameters())
    # Agreeing ones are fine.
    pipe.step(x, y, nn.MSELoss(reduction="sum"), loss_reduction="sum")


def token_model() -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, VOCAB)
    ).double()
    return model, copy.deepcopy(model)


def tokens() -> tuple[Tensor, Tensor]:
    """4 sequences of 5 tokens; padding leaves 5, 1, 3 and 2 targets (-100 elsewhere)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, VOCAB, (4, 5), generator=gen)
    y = torch.randint(0, VOCAB, (4, 5), generator=gen)
    for row, kept in enumerate([5, 1, 3, 2]):
        y[row, kept:] = -100
    return x, y


def summed_tokens(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1), reduction="sum")


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_mean_over_tokens_with_a_divisor_equals_the_plain_model(
    schedule: str, as_tensor: bool
) -> None:
    model, plain = token_model()
    x, y = tokens()
    expected = F.cross_entropy(plain(x).reshape(-1, VOCAB), y.reshape(-1))  # ignore_index=-100
    expected.backward()
    pipe = Pipe(model, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=4)
    count = (y != -100).sum()
    divisor = count if as_tensor else int(count)
    loss = pipe.step(
        x, y, summed_tokens, schedule=SCHEDULES[schedule](), loss_reduction="sum",
        loss_divisor=divisor,
    )  # fmt: skip
    torch.testing.assert_close(loss, expected.detach())
    assert_same(grads(pipe), grads(plain), schedule)
    evaluated = pipe.evaluate(x, y, summed_tokens, loss_reduction="sum", loss_divisor=divisor)
    torch.testing.assert_close(evaluated, expected.detach())
    # Weighing the micro-batches' token means by rows is not the plain model's mean.
    rows_weighted = pipe.evaluate(x, y, lambda o, t: summed_tokens(o, t) / (t != -100).sum())
    assert not math.isclose(float(rows_weighted), float(expected.detach()), rel_tol=1e-3)


def test_a_divisor_that_cannot_divide_a_sum_is_refused() -> None:
    model, _ = two_blocks()
    pipe = Pipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=2)
    x, y = batch(4)
    with pytest.raises(ValueError, match="loss_divisor divides a summed loss"):
        pipe.step(x, y, F.mse_loss, loss_divisor=4)
    with pytest.raises(ValueError, match="positive number, got 0"):
        pipe.step(x, y, nn.MSELoss(reduction="sum"), loss_divisor=0)
    with pytest.raises(ValueError, match="positive number, got nan"):
        pipe.evaluate(x, y, nn.MSELoss(reduction="sum"), loss_divisor=float("nan"))
    with pytest.raises(TypeError, match="got str"):
        pipe.step(x, y, nn.MSELoss(reduction="sum"), loss_divisor="4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tensor of shape \(2,\)"):
        pipe.step(x, y, nn.MSELoss(reduction="sum"), loss_divisor=torch.ones(2))
    with pytest.raises(ValueError, match=r"requires grad.*loss_divisor=divisor\.detach\(\)"):
        # It failed midway: each micro-batch's backward walked the divisor's graph.
        divisor = torch.ones((), requires_grad=True) * 4
        pipe.step(x, y, nn.MSELoss(reduction="sum"), loss_divisor=divisor)
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_target_with_a_history_gets_the_plain_models_gradient_once(
    schedule: str, checkpoint: str
) -> None:
    # A target computed from a tensor that requires grad (a distillation target, tanh(a)):
    # each micro-batch's backward walked the caller's graph behind it, and the second
    # failed midway ("backward through the graph a second time") after .grad was written.
    torch.manual_seed(4)
    model = nn.Sequential(*(block() for _ in range(4))).double()
    plain = copy.deepcopy(model)
    x, y = batch(8)
    a, b = y.clone().requires_grad_(), y.clone().requires_grad_()
    fired: list[Tensor] = []
    a.register_hook(lambda grad: fired.append(grad) or None)
    F.mse_loss(plain(x), torch.tanh(b)).backward()
    pipe = Pipe(model, [1] * 4, devices=["cpu"] * 4, chunks=4, checkpoint=checkpoint)  # type: ignore[arg-type]
    pipe.step(x, torch.tanh(a), F.mse_loss, schedule=SCHEDULES[schedule]())
    assert_same(grads(model), grads(plain), schedule)
    torch.testing.assert_close(a.grad, b.grad)
    assert len(fired) == 1
    pipe.close()


def test_a_grad_scaler_scales_each_backward_and_the_step_returns_the_unscaled_loss() -> None:
    torch.manual_seed(9)
    model = nn.Sequential(block(), block(), block())
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=3)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in "ab"]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, plain)]
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = torch.randn(6, WIDTH, generator=gen), torch.randn(6, WIDTH, generator=gen)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = pipe.step(x, y, F.mse_loss, grad_scaler=scalers[0])
        expected = F.mse_loss(plain(x), y)
        scalers[1].scale(expected).backward()
        torch.testing.assert_close(loss, expected.detach())
        for mine, theirs in zip(pipe.parameters(), plain.parameters(), strict=True):
            assert mine.grad is not None and theirs.grad is not None
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-4)
            if step == 2:  # an overflow: both skip the step and back off
                mine.grad[0] = theirs.grad[0] = float("inf")
        for scaler, optimizer in zip(scalers, optimizers, strict=True):
            scaler.step(optimizer)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert scalers[0].get_scale() == 2.0**10  # grew at step 1, backed off at step 2
    for mine, theirs in zip(pipe.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)


def test_a_grad_scaler_for_another_device_or_not_one_is_refused() -> None:
    model, _ = two_blocks()
    pipe = Pipe(model, [1, 1, 1], devices=["cpu"] * 3)
    x, y = batch(2)
    with pytest.raises(TypeError, match=r"must be a torch\.amp\.GradScaler, got float"):
        pipe.step(x, y, F.mse_loss, grad_scaler=2.0**16)  # type: ignore[arg-type]
    scaler = torch.amp.GradScaler("cpu")
    scaler._device = "cuda"  # as built for CUDA (there is none here)
    with pytest.raises(ValueError, match=r"made for 'cuda', but the loss is computed on cpu"):
        pipe.step(x, y, F.mse_loss, grad_scaler=scaler)
