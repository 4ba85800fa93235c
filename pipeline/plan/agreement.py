"""Planning in every process of a group: the same plan everywhere, from agreed numbers.

Every process calls ``pipeline.plan(..., processes=N)`` with the same
arguments. What each computes alone and exactly (the arguments, the bytes
of the memory profile) is compared first, as fixed-length rows of hashes
(``pipeline/runtime/agreement.py``): a process whose model, batch or
arguments differ makes every process raise, naming the ranks, before any
measurement. What is timed is timed once, on rank 0 (the layers), or
taken as the largest over the ranks (a step's time in the pipeline, the
cost of an action), and sent to every rank as float64 tensors: the search
then runs on the same numbers everywhere, so every process chooses the
same configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from pipeline.runtime.agreement import (
    camps,
    fingerprint,
    gather_rows,
    ranks_text,
    refusal_elsewhere,
)
from pipeline.runtime.process_group import collective_device

__all__ = ["agree_inputs", "from_rank_zero", "largest"]


def agree_inputs(
    group: dist.ProcessGroup,
    refusal: Exception | None,
    text: str,
    replicas: dist.ProcessGroup | None = None,
) -> None:
    """Raise on every rank unless every rank passed its own checks and has the same ``text``.

    A collective: a rank that refused (``refusal``) raises its own error,
    the others one naming it. With ``replicas`` (the groups across a mesh's
    pipelines: each rank is in one of each), a second round there: then
    every rank of the mesh raises where any one would.
    """
    error = _disagreement(group, refusal, text)
    if replicas is not None:
        error = _disagreement(replicas, error, text)
    if error is not None:
        raise error


def _disagreement(
    group: dist.ProcessGroup, refusal: Exception | None, text: str
) -> Exception | None:
    """What every rank of ``group`` raises (None: nothing): ``agree_inputs``'s round."""
    rows = gather_rows([int(refusal is not None), fingerprint(text)], group)
    if refusal is not None:
        return refusal
    elsewhere = refusal_elsewhere(rows, "refused its pipeline.plan arguments", "no process planned")
    if elsewhere is not None:
        return elsewhere
    split = camps([row[1] for row in rows])
    if len(split) > 1:
        return ValueError(
            f"pipeline.plan was called differently in the processes of the group: "
            f"{ranks_text(split)} differ in the model, the sample batch, the target or the "
            "arguments (compared: every argument and the bytes the model saves, per micro-batch "
            "size); call it with the same ones in every process so that every process builds "
            "the same pipeline"
        )
    return None


def from_rank_zero(
    group: dist.ProcessGroup, count: int, measure: Callable[[], Sequence[float]]
) -> list[float]:
    """``measure()`` on rank 0 (``count`` numbers), the same numbers on every rank."""
    values = torch.zeros(count, dtype=torch.float64)
    if dist.get_rank(group) == 0:
        measured = list(measure())
        assert len(measured) == count, f"{len(measured)} numbers measured, {count} announced"
        values = torch.tensor(measured, dtype=torch.float64)
    sent = values.to(collective_device(group))
    dist.broadcast(sent, group=group, group_src=0)
    return [float(v) for v in sent.tolist()]


def largest(group: dist.ProcessGroup, value: float) -> float:
    """The largest ``value`` of the ranks, on every rank."""
    mine = torch.tensor([value], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return float(mine.item())
