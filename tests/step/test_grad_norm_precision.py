"""Pipe.clip_grad_norm_ with bfloat16 and float16 gradients: each gradient's norm in its
dtype, their total and the factor in float64, the norm returned in float32 (docs/guide.md,
"Gradient clipping"), where torch rounds its total and factor to the gradients' dtype."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from pipeline import Pipe

MAX_NORM = 1.0


def pipe_with_grads(dtype: torch.dtype, scale: float) -> tuple[Pipe, list[Tensor]]:
    """A pipe of ``dtype`` layers whose gradients are set, and a copy of them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()).to(dtype)
    pipe = Pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=1)
    gen = torch.Generator().manual_seed(1)
    for p in pipe.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(dtype)
    return pipe, [p.grad.clone() for p in pipe.parameters() if p.grad is not None]


def float64_total(grads: list[Tensor]) -> Tensor:
    """The total of the gradients' norms, each taken in its dtype, in float64."""
    norms = [torch.linalg.vector_norm(g).double() for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_clipping_takes_the_total_and_factor_in_float64(
    dtype: torch.dtype,
) -> None:
    pipe, before = pipe_with_grads(dtype, 3.0)
    norm = pipe.clip_grad_norm_(MAX_NORM)
    total = float64_total(before)
    assert norm.dtype == torch.float32
    assert torch.equal(norm, total.float())
    # Within each gradient's norm's rounding of the norm of the float64 gradients.
    exact = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in before]))
    assert abs(norm.double() - exact) <= torch.finfo(dtype).eps * exact
    factor = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
    clipped = [p.grad for p in pipe.parameters() if p.grad is not None]
    for k, (got, grad) in enumerate(zip(clipped, before, strict=True)):
        assert got.dtype == dtype
        assert torch.equal(got, grad * factor.to(dtype)), k
    pipe.close()


def test_a_float16_total_past_its_range_is_finite_where_each_norm_is() -> None:
    """Torch's float16 total is inf there, which would clip every gradient to zero."""
    pipe, before = pipe_with_grads(torch.float16, 6000.0)
    assert torch.isinf(torch.linalg.vector_norm(torch.stack([g.norm() for g in before])))
    norm = pipe.clip_grad_norm_(MAX_NORM)
    total = float64_total(before)
    assert 65504 < total < float("inf")
    assert torch.equal(norm, total.float())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in pipe.parameters())
    pipe.close()
