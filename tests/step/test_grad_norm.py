"""Pipe.clip_grad_norm_: the plain model's clip_grad_norm_, on the pipe's gradients.

Across processes (tied weights counted once, every stage's norm) it is
stage_scenarios.py's clip_grad_norm_clips_by_the_whole_models_norm_counting_tied_weights_once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import Pipe
from tests.helpers import grads, mlp


def tied() -> nn.Sequential:
    torch.manual_seed(3)
    shared = nn.Linear(8, 8)
    return nn.Sequential(shared, nn.Tanh(), nn.Linear(8, 8), shared, nn.Tanh()).double()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf"), -float("inf"), 0.0])
@pytest.mark.parametrize("max_norm", [0.01, 1e6], ids=["clips", "leaves"])
@pytest.mark.parametrize("build", [mlp, tied], ids=["mlp", "tied on one device"])
def test_equals_the_plain_models_clip_grad_norm(
    build: Callable[[], nn.Sequential], max_norm: float, norm_type: float
) -> None:
    model = build()
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [3, 2] if len(model) == 5 else [3, 3], devices=["cpu", "cpu"], chunks=3)
    x, y = torch.randn(6, 8, dtype=torch.double), torch.randn(6, 8, dtype=torch.double)
    F.mse_loss(plain(x), y).backward()
    pipe.step(x, y, F.mse_loss)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
    # The gradients themselves agree to rounding (micro-batches are summed in another order).
    torch.testing.assert_close(
        pipe.clip_grad_norm_(max_norm, norm_type), expected, rtol=1e-13, atol=0
    )
    clipped, reference = grads(pipe), grads(plain)
    assert clipped.keys() == reference.keys()
    for name, grad in clipped.items():
        torch.testing.assert_close(grad, reference[name], rtol=0, atol=1e-15, msg=name)
    pipe.close()


def test_a_nonfinite_norm_is_refused_when_asked_and_changes_nothing() -> None:
    pipe = Pipe(mlp(), [3, 3], devices=["cpu", "cpu"], chunks=2)
    pipe(torch.randn(4, 8, dtype=torch.double)).sum().backward()
    first = next(pipe.parameters())
    assert first.grad is not None
    first.grad[0, 0] = float("nan")
    before = grads(pipe)
    with pytest.raises(
        RuntimeError, match=r"total norm of order 2\.0 .* is nan.*error_if_nonfinite"
    ):
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    after = grads(pipe)
    assert all(torch.equal(after[n], g) for n, g in before.items() if n != "0.weight")
    pipe.close()


def test_parameters_without_gradients_count_nothing() -> None:
    pipe = Pipe(mlp(), [3, 3], devices=["cpu", "cpu"], chunks=2)
    assert torch.equal(pipe.clip_grad_norm_(1.0), torch.zeros(()))
    pipe.close()
