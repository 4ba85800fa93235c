"""The planner's arguments, checked before any profiling: each refusal says what to pass instead."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TypeGuard, cast

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from pipeline.arguments import Device, resolve_devices
from pipeline.runtime.microbatch import scatter
from pipeline.runtime.router_loss import ASKED, asked

__all__ = [
    "CHECKPOINTS",
    "SCHEDULES",
    "check_placement",
    "check_plan_arguments",
    "default_chunks",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h1-peak")
CHECKPOINTS = ("never", "except_last", "always")


def default_chunks(batch_size: int) -> tuple[int, ...]:
    """The powers of two up to 32 that divide ``batch_size``.

    >>> default_chunks(24)
    (1, 2, 4, 8)
    """
    return tuple(c for c in (1, 2, 4, 8, 16, 32) if batch_size % c == 0)


def check_target_rows(target: object, batch_size: int) -> None:
    """Refuse a target (holding tensors) whose rows are not the sample's: its micro-batches
    would not be the input's."""
    holds = any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(target))
    split = scatter(target, 1) if holds else []
    if split and split[0].rows() != batch_size:
        raise ValueError(
            f"batch_size={batch_size} but the target has {split[0].rows()} rows; pass the "
            "target of the same mini-batch as the sample input, as pipe.step will take them"
        )


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
    what: str = "devices",
) -> tuple[nn.Sequential, list[torch.device], int, int, tuple[int, ...]]:
    """The model, devices, batch size, limit and micro-batch counts, once all are usable.

    ``chunks`` None: ``default_chunks`` of the batch size. ``what``: what
    the stages are, as a refusal names them (``devices`` or ``processes``).
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
    # A CUDA device the machine lacks is refused there.
    resolved = resolve_devices(cast(Sequence[Device], devices), len(devices))
    if any(d.type == "meta" for d in resolved):
        raise ValueError(
            f"devices {[str(d) for d in resolved]} include the meta device, which holds no "
            "data: the planner profiles the layers where they will run; give real devices"
        )
    if len(resolved) > len(model):
        raise ValueError(
            f"{len(resolved)} {what} but the model has {len(model)} layers; every stage needs "
            f"a layer at least: pass fewer {what}"
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
    _refuse_router_loss_schedules(model, schedules)
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


def check_placement(
    devices: object,
    processes: object,
    link_latency: object,
    link_seconds_per_byte: object,
    in_group: bool,
    action_overhead: object,
) -> int | None:
    """The number of processes planned for, or None for a Pipe on ``devices``.

    Exactly one of ``devices`` and ``processes``; the link's two numbers
    together or neither, and only with ``processes``; outside a process
    group, where nothing can be measured between processes, both of them
    and ``action_overhead``.
    """
    if (devices is None) == (processes is None):
        raise TypeError(
            "pass devices=[...] (one device per stage, for a Pipe in this process) or "
            "processes=N (N stages, one process each, for a DistributedPipe), exactly one of "
            f"them; got devices={devices!r}, processes={processes!r}"
        )
    link = {"link_latency": link_latency, "link_seconds_per_byte": link_seconds_per_byte}
    given = [name for name, value in link.items() if value is not None]
    if processes is None:
        if given:
            raise ValueError(
                f"{' and '.join(given)} cost the messages between processes: plan with "
                "processes=N to use them (a Pipe's stages share one process)"
            )
        return None
    count = _positive_int("processes", processes)
    if len(given) == 1:
        raise ValueError(
            f"only {given[0]} was given: pass link_latency (seconds per message) and "
            "link_seconds_per_byte together, or neither to measure them in the process group"
        )
    for name, value in link.items():
        if value is not None and not (_finite(value) and value >= 0):
            raise ValueError(f"{name} must be a number of seconds, 0 or more, got {value!r}")
    if not in_group and (not given or action_overhead is None):
        raise ValueError(
            "planning for processes measures the link between them and a DistributedPipe's "
            "cost per action in the process group, but torch.distributed is not initialised "
            "here: call pipeline.plan in every process of the group (after "
            "init_process_group), or pass link_latency=, link_seconds_per_byte= and "
            "action_overhead= to plan without one"
        )
    return count


def check_measures(repeats: object, action_overhead: object, contention: object) -> None:
    """Refuse measures given by hand that no machine has: each would give figures of none."""
    _positive_int("repeats", repeats)
    if action_overhead is not None and not (_finite(action_overhead) and action_overhead >= 0):
        raise ValueError(
            f"action_overhead must be None (measured now) or 0 or more seconds, got "
            f"{action_overhead!r}"
        )
    if contention is not None and not (_finite(contention) and contention > 0):
        raise ValueError(
            "contention must be None (measured now) or a factor above 0 (1.0: the CPU stages "
            f"run as fast together as alone), got {contention!r}"
        )


def _finite(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is a finite int or float (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


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


def _refuse_router_loss_schedules(model: nn.Sequential, schedules: Sequence[str]) -> None:
    """Refuse schedules a model asking for its router loss cannot step with (GPipe only)."""
    others = [s for s in schedules if s != "gpipe"]
    if asked(getattr(model, "router_loss", None)) is not None and others:
        raise ValueError(
            f"{ASKED}, a load-balancing loss over the whole batch that only GPipe gives "
            f"exactly (docs/split.md); schedules "
            f"{others} would be refused at their first step: pass schedules=('gpipe',)"
        )


def _subset(name: str, given: Sequence[str], known: tuple[str, ...]) -> None:
    if isinstance(given, str) or not given or any(g not in known for g in given):
        raise ValueError(f"{name} must be a non-empty list of {list(known)}, got {given!r}")
