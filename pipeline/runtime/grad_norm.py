"""A whole pipeline's gradient norm, and clipping by it, as torch's ``clip_grad_norm_``.

``torch.nn.utils.clip_grad_norm_(pipe.parameters(), c)`` in a process of a
``DistributedPipe`` sees that process's stages only, so each stage would be
clipped by its own norm. Here each process takes the norms of its gradients
(a DTensor's gradient, sharded by FSDP2 or tensor parallelism, by its whole
norm), and the processes of the pipeline combine them:

    norm_p = ( sum over processes of  sum over their gradients |g|^p ) ^ (1/p)
    norm_inf = max over processes of max |g|      (-inf: min, of min |g|)
    norm_0 = sum over processes of their gradients with a nonzero entry

so every process gets the plain model's norm and scales by the same factor.
The total and the factor are float64 whatever the gradients' dtypes, so
processes holding bfloat16 and float32 stages combine the same numbers;
torch rounds its own to the gradients' dtype, so in bfloat16 and float16
the two differ by about a unit in the last place (docs/guide.md, "Gradient
clipping"), and are equal bit for bit in float32 and float64.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from pipeline.runtime.agreement import camps, gather_rows, ranks_text

__all__ = ["clip_grad_norm", "total_norm"]


def total_norm(
    grads: list[Tensor],
    norm_type: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> Tensor:
    """The ``norm_type``-norm of every gradient of the pipeline, on ``device``, in float64.

    ``group`` is the pipeline's processes (None: this process holds it whole).
    In float64 whatever the gradients' dtypes: every process computes and
    reduces the same dtype (processes of bfloat16 and of float32 stages).
    """
    p = float(norm_type)
    norms = [_whole_norm(g, p).to(device, torch.float64) for g in grads]
    if not norms:
        # What adds nothing to the others' (a minimum: nothing below it).
        empty = float("inf") if p == -float("inf") else 0.0
        here = torch.full((), empty, device=device, dtype=torch.float64)
    else:
        here = torch.linalg.vector_norm(torch.stack(norms), p)
    if group is None:
        return here
    if p in (float("inf"), -float("inf")):
        op = dist.ReduceOp.MAX if p > 0 else dist.ReduceOp.MIN
        dist.all_reduce(here, op=op, group=group)
        return here
    if p == 0:  # a count: of the gradients with a nonzero entry
        dist.all_reduce(here, group=group)
        return here
    powered = here**p
    dist.all_reduce(powered, group=group)
    return powered ** (1.0 / p)


def clip_grad_norm(
    params: Iterable[torch.nn.Parameter],
    counted: Iterable[torch.nn.Parameter],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> Tensor:
    """Scale the gradients of ``params`` so that the pipeline's norm is at most ``max_norm``.

    Returns the norm before scaling, in float32 or the widest dtype of this
    process's gradients (in float64, as reduced, where it holds none).
    ``counted`` are those of ``params`` whose gradients
    the norm counts: a weight tied across processes is counted at one of its
    holders and scaled at every one.
    """
    if group is not None:
        _check_alike(max_norm, norm_type, error_if_nonfinite, group)
    grads = [p.grad for p in counted if p.grad is not None]
    norm = total_norm(grads, norm_type, group, device)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"the total norm of order {float(norm_type)} of the pipeline's gradients is "
            f"{norm.item()}, so clip_grad_norm_ cannot scale them; pass "
            "error_if_nonfinite=False to scale them anyway (as torch's clip_grad_norm_)"
        )
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    scaled = [p.grad for p in params if p.grad is not None]
    with torch.no_grad():
        for g in scaled:
            _local(g).mul_(factor.to(g.device, g.dtype))
    # Of every gradient here, counted or not: a process holding only weights
    # counted at another holder gave float32.
    if not scaled:
        return norm
    widest = torch.float32
    for g in scaled:
        widest = torch.promote_types(widest, g.dtype)
    return norm.to(widest)


def _check_alike(
    max_norm: float, norm_type: float, error_if_nonfinite: bool, group: dist.ProcessGroup
) -> None:
    """Refuse, on every process, arguments that differ between the processes: each would
    scale by its own factor (or reduce the norm with another collective)."""
    mine = (float(max_norm), float(norm_type), bool(error_if_nonfinite))
    row = [*(struct.unpack("<q", struct.pack("<d", value))[0] for value in mine[:2]), mine[2]]
    rows = gather_rows(row, group)
    alike = camps([hash(tuple(theirs)) for theirs in rows])
    if len(alike) > 1:
        raise ValueError(
            f"clip_grad_norm_ was called with different arguments by the processes of the "
            f"pipeline: {ranks_text(alike)} differ (this process: max_norm={mine[0]}, "
            f"norm_type={mine[1]}, error_if_nonfinite={mine[2]}); nothing was clipped: call "
            "it with the same arguments on every process"
        )


def _whole_norm(grad: Tensor, p: float) -> Tensor:
    """``grad``'s norm; for a DTensor, of the whole tensor its shards make up."""
    if p in (float("inf"), -float("inf")) and hasattr(grad, "to_local"):
        return _extreme_of_shards(grad, p)
    norm = torch.linalg.vector_norm(grad, p)
    full = getattr(norm, "full_tensor", None)  # a DTensor: its norm is reduced over its mesh
    return cast(Tensor, full()) if full is not None else norm


def _extreme_of_shards(grad: Tensor, p: float) -> Tensor:
    """A DTensor's largest (``inf``) or smallest (``-inf``) entry in magnitude, from its
    shards: one may be empty (a ``Linear(16, 1)``'s weight over two ranks), whose norm torch
    refuses, as it has no identity; the empty one gives the identity of max or min here."""
    local = _local(grad)
    here: Tensor
    if local.numel():
        here = torch.linalg.vector_norm(local, p).to(torch.float64)
    else:
        identity = 0.0 if p > 0 else float("inf")
        here = torch.tensor(identity, dtype=torch.float64, device=local.device)
    mesh = grad.device_mesh  # type: ignore[attr-defined]
    op = dist.ReduceOp.MAX if p > 0 else dist.ReduceOp.MIN
    for dim in range(mesh.ndim):
        dist.all_reduce(here, op=op, group=mesh.get_group(dim))
    return here


def _local(grad: Tensor) -> Tensor:
    """What this process holds of ``grad``: a DTensor's local shard, else ``grad``."""
    to_local = getattr(grad, "to_local", None)
    return cast(Tensor, to_local()) if to_local is not None else grad
