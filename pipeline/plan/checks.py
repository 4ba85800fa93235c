"""The planner's arguments, checked before any profiling: each refusal says what to pass instead."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import nn

from pipeline.runtime.microbatch import scatter

__all__ = ["CHECKPOINTS", "SCHEDULES", "check_plan_arguments", "default_chunks"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
CHECKPOINTS = ("never", "except_last", "always")


def default_chunks(batch_size: int) -> tuple[int, ...]:
    """The powers of two up to 32 that divide ``batch_size``.

    >>> default_chunks(24)
    (1, 2, 4, 8)
    """
    return tuple(c for c in (1, 2, 4, 8, 16, 32) if batch_size % c == 0)


def check_plan_arguments(
    model: object,
    sample: object,
    devices: Sequence[object],
    batch_size: object,
    memory_limit: object,
    chunks: Sequence[object] | None,
    schedules: Sequence[str],
    checkpoints: Sequence[str],
    optimizer_bytes_per_param: object,
) -> tuple[nn.Sequential, list[torch.device], int, int, tuple[int, ...]]:
    """The model, devices, batch size, limit and micro-batch counts, once all are usable.

    ``chunks`` None: ``default_chunks`` of the batch size.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"plan takes an nn.Sequential, as Pipe does, got {type(model).__name__}; "
            "cut any other model into one with pipeline.split(model, (sample,)) first"
        )
    if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
        raise TypeError(
            f"devices must be a non-empty list of devices, one per pipeline stage (such as "
            f"['cpu', 'cpu']), got {devices!r}"
        )
    resolved = [torch.device(d) for d in devices]  # type: ignore[call-overload]
    if len(resolved) > len(model):
        raise ValueError(
            f"{len(resolved)} devices but the model has {len(model)} layers; every stage needs "
            "a layer at least: pass fewer devices"
        )
    size = _positive_int("batch_size", batch_size)
    limit = _positive_int("memory_limit", memory_limit)
    rows = scatter(sample, 1)[0].rows()
    if rows != size:
        raise ValueError(
            f"batch_size={size} but the sample input has {rows} rows; pass one mini-batch as "
            "pipe.step will take it (its rows are the batch size), and the same batch_size"
        )
    counts = (
        default_chunks(size)
        if chunks is None
        else tuple(_positive_int("chunks", c) for c in chunks)
    )
    if not counts:
        raise ValueError("chunks is empty: give the micro-batch counts to try, such as (2, 4, 8)")
    wrong = [c for c in counts if size % c]
    if wrong:
        raise ValueError(
            f"chunks {wrong} do not divide batch_size={size}: the planner compares micro-batches "
            f"of equal size; try divisors of {size}, such as {list(default_chunks(size))}"
        )
    _subset("schedules", schedules, SCHEDULES)
    _subset("checkpoints", checkpoints, CHECKPOINTS)
    if (
        isinstance(optimizer_bytes_per_param, bool)
        or not isinstance(optimizer_bytes_per_param, numbers.Integral)
        or int(optimizer_bytes_per_param) < 0
    ):
        raise ValueError(
            "optimizer_bytes_per_param must be an int of 0 or more (8 for AdamW's two float32 "
            f"states, 4 for SGD with momentum), got {optimizer_bytes_per_param!r}"
        )
    return model, resolved, size, limit, counts


def _positive_int(name: str, value: object) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise TypeError(f"{name} must be a whole number, got {type(value).__name__} {value!r}")
    if value <= 0:
        unit = " (bytes per device)" if name == "memory_limit" else ""
        raise ValueError(f"{name} must be positive{unit}, got {value!r}")
    return int(value)


def _subset(name: str, given: Sequence[str], known: tuple[str, ...]) -> None:
    if isinstance(given, str) or not given or any(g not in known for g in given):
        raise ValueError(f"{name} must be a non-empty list of {list(known)}, got {given!r}")
