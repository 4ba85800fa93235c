"""Losses: how a step weighs each micro-batch's loss, so that the sum is the plain model's.

``loss_fn`` runs once per micro-batch on the last stage (again in the
recomputation of a checkpointed last stage). What the plain model
computes once over the mini-batch, the step rebuilds from those losses with
a weight per micro-batch (``loss_scales``):

- ``"mean"``: a micro-batch of r rows out of R weighs r / R. Exact when the
  loss is a mean over rows (or over elements, rows times a fixed size);
- ``"sum"``: each weighs 1;
- ``"sum"`` with ``loss_divisor=N``: each weighs 1 / N. Exact for a mean
  over anything the caller counts in the whole batch beforehand, such as the
  tokens that ``ignore_index`` leaves: ``N = (y != -100).sum()``.

A loss module (``nn.MSELoss(reduction="sum")``), or a ``functools.partial``
giving ``reduction=``, carries its own reduction: the step takes it, and
refuses ``"none"`` or a different ``loss_reduction`` before any work
(``resolve_reduction``). With a ``torch.amp.GradScaler`` each micro-batch's
backward starts from its scaled loss, and the step returns the unscaled one.
A split transformers model's own ``out.loss`` is checked against these
weights before a step (``token_loss.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn

from pipeline.arguments import LossReduction
from pipeline.runtime.stream import copy_to

__all__ = [
    "LossDivisor",
    "LossFn",
    "Scale",
    "check_divisor",
    "check_grad_scaler",
    "loss_scales",
    "resolve_reduction",
    "scaled",
]

# loss_fn(output, target) of one micro-batch: a scalar tensor.
LossFn: TypeAlias = Callable[[Any, Any], Tensor]
# A count given by the caller: a number, or a 0-dim tensor (not read back, so no sync).
LossDivisor: TypeAlias = int | float | Tensor
# What a micro-batch's loss is multiplied by.
Scale: TypeAlias = float | Tensor

# Loss reductions that weigh micro-batches by rows: KLDivLoss's "batchmean" is a
# sum divided by the rows.
_BY_ROWS = {"mean": "mean", "batchmean": "mean", "sum": "sum"}


def resolve_reduction(loss_fn: Any, given: Any) -> LossReduction:
    """The step's reduction: ``given``, the one ``loss_fn`` carries, or ``"mean"``.

    >>> resolve_reduction(nn.MSELoss(reduction="sum"), None)
    'sum'
    >>> resolve_reduction(torch.nn.functional.mse_loss, None)
    'mean'
    """
    if given is not None and given not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {given!r}")
    own = _carried_reduction(loss_fn)
    if own is None:
        return "mean" if given is None else given
    name = type(loss_fn).__name__
    if own == "none":
        raise ValueError(
            f"loss_fn ({name}) has reduction='none': it returns a loss per element, but a "
            "micro-batch's loss must be a scalar; build it with reduction='mean' or 'sum'"
        )
    if own not in _BY_ROWS:
        raise ValueError(
            f"loss_fn ({name}) has reduction={own!r}, which a step cannot weigh per "
            "micro-batch; use reduction='mean' or 'sum'"
        )
    carried: LossReduction = _BY_ROWS[own]  # type: ignore[assignment]
    if given is not None and given != carried:
        raise ValueError(
            f"loss_reduction={given!r}, but loss_fn ({name}) has reduction={own!r}: the "
            f"step would weigh its micro-batches' losses as {given!r} reductions; leave "
            "loss_reduction out (the loss function's is used) or make the two agree"
        )
    return carried


def _carried_reduction(loss_fn: Any) -> Any:
    """The ``reduction`` a loss module or a ``partial`` carries, or None."""
    if isinstance(loss_fn, nn.Module):
        return getattr(loss_fn, "reduction", None)
    if isinstance(loss_fn, functools.partial):
        return loss_fn.keywords.get("reduction")
    return None


def check_divisor(divisor: Any, reduction: LossReduction) -> None:
    """Refuse a ``loss_divisor`` that cannot divide a summed loss."""
    if divisor is None:
        return
    if reduction != "sum":
        raise ValueError(
            "loss_divisor divides a summed loss: pass loss_reduction='sum' and a loss_fn "
            "that sums, e.g. F.cross_entropy(..., reduction='sum')"
        )
    if isinstance(divisor, Tensor):
        if divisor.numel() != 1 or divisor.is_complex():
            raise ValueError(
                f"loss_divisor must be a number or a tensor holding one real number, got a "
                f"tensor of shape {tuple(divisor.shape)} and dtype {divisor.dtype}"
            )
        if divisor.requires_grad:
            raise ValueError(
                "loss_divisor requires grad: a count divides the loss, with no gradient of "
                "its own to give; pass loss_divisor=divisor.detach()"
            )
        return
    if isinstance(divisor, bool) or not isinstance(divisor, int | float):
        raise TypeError(f"loss_divisor must be a number or a tensor, got {type(divisor).__name__}")
    if not (math.isfinite(divisor) and divisor > 0):
        raise ValueError(f"loss_divisor must be a positive number, got {divisor!r}")


def loss_scales(
    rows: list[int], reduction: LossReduction, divisor: LossDivisor | None = None
) -> list[Scale]:
    """What each micro-batch's loss is multiplied by, so the step's gradient is the batch's.

    ``'mean'``: a micro-batch of r rows out of R counts r / R (uneven splits
    included); ``'sum'``: each counts once; ``'sum'`` with a divisor N: each
    counts 1 / N.

    >>> loss_scales([3, 3, 3, 1], "mean")
    [0.3, 0.3, 0.3, 0.1]
    >>> loss_scales([3, 1], "sum")
    [1.0, 1.0]
    >>> loss_scales([3, 1], "sum", 8)
    [0.125, 0.125]
    """
    if divisor is not None:
        # A tensor's reciprocal in float64, cast to each loss's dtype by ``scaled``.
        scale = divisor.double().reciprocal() if isinstance(divisor, Tensor) else 1.0 / divisor
        return [scale] * len(rows)
    total = sum(rows)
    return [r / total if reduction == "mean" else 1.0 for r in rows]


def scaled(loss: Tensor, scale: Scale) -> Tensor:
    """``loss`` times its micro-batch's weight, a number or a tensor on any device.

    A weight of exactly 1.0 (``'sum'``) leaves the loss as it is: the product
    would equal it, and its gradient the gradient, bit for bit. A tensor
    weight gives what a number gives, value and gradient alike
    (``_by_tensor``).
    """
    if isinstance(scale, Tensor):
        return _by_tensor(loss, scale)
    if scale == 1.0:
        return loss
    return loss * scale


# Loss dtypes that torch multiplies by a number in float32, rounding only the product to
# the dtype: 1/N in float16 itself is off by up to 18% (a subnormal past N=16384).
_COMPUTED_IN_FLOAT32 = (torch.float16, torch.bfloat16)


def _by_tensor(loss: Tensor, scale: Tensor) -> Tensor:
    """``loss * scale`` as torch computes ``loss * float(scale)``, without reading it back.

    The gradient reaching ``loss`` is the weight rounded to its dtype, as the
    number's and the plain model's ``loss / N`` give.
    """
    product = loss * copy_to(scale, loss.device, _weight_dtype(loss.dtype))
    return product.to(loss.dtype) if loss.dtype in _COMPUTED_IN_FLOAT32 else product


def _weight_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch takes a number in to multiply a tensor of ``dtype`` by it."""
    if dtype in _COMPUTED_IN_FLOAT32:
        return torch.float32
    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    # A count (of correct predictions) weighed by 1/N: a float of the default dtype, not 0.
    return torch.get_default_dtype()


def check_grad_scaler(scaler: Any, device: torch.device) -> None:
    """Refuse what is not a ``torch.amp.GradScaler`` for the device the loss is on."""
    if scaler is None:
        return
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    # The scaler's device type: a private attribute, read only to refuse early.
    kind = getattr(scaler, "_device", device.type)
    if scaler.is_enabled() and kind != device.type:
        raise ValueError(
            f"grad_scaler was made for {kind!r}, but the loss is computed on {device}: build "
            f"it as torch.amp.GradScaler({device.type!r})"
        )
