"""``pipeline.plan``: choose a Pipe's balance, micro-batches, schedule and checkpointing.

Read in this order: ``profile.py`` (what is measured of the model, per
micro-batch size), ``memory.py`` and ``timing.py`` (the two models),
``partition.py`` (the balance for time and memory together), ``search.py``
(every configuration), ``result.py`` (``Plan``, its table, ``pipe()``,
``check()``). docs/plan.md writes the model down, with its measured error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from pipeline.plan.checks import CHECKPOINTS, SCHEDULES, check_plan_arguments
from pipeline.plan.contention import cpu_contention
from pipeline.plan.memory import layer_parameters
from pipeline.plan.overhead import action_overhead as measured_overhead
from pipeline.plan.profile import LayerTimes, Saved, layer_times, saved_storages
from pipeline.plan.result import Plan, PlanCheck, PlanError, choose
from pipeline.plan.search import Candidate, candidates
from pipeline.runtime.microbatch import Arguments, scatter

__all__ = ["Candidate", "Plan", "PlanCheck", "PlanError", "plan"]


def plan(
    model: nn.Sequential,
    sample_input: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    devices: Sequence[Any],
    batch_size: int,
    memory_limit: int,
    kwargs: Mapping[str, Any] | None = None,
    chunks: Sequence[int] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    checkpoints: Sequence[str] = CHECKPOINTS,
    optimizer_bytes_per_param: int = 0,
    repeats: int = 5,
    action_overhead: float | None = None,
    contention: float | None = None,
) -> Plan:
    """The fastest predicted Pipe configuration whose predicted peak fits ``memory_limit``.

    ``sample_input`` and ``target`` are one mini-batch of ``batch_size`` rows
    as ``pipe.step`` takes them (``kwargs``: the first layer's keyword
    arguments, split like the input), ``loss_fn`` the step's loss;
    ``devices`` one device per pipeline stage; ``memory_limit`` bytes per
    device (partitions sharing a device share it). Each layer is profiled
    once per micro-batch size (``repeats`` timed runs, medians), on
    ``devices[0]``, on copies: the model is left as it was. Then every
    schedule of ``schedules`` x micro-batch count of ``chunks`` (default: the
    powers of two up to 32 dividing ``batch_size``) x checkpoint mode of
    ``checkpoints`` gets its balance for time and memory together, a
    predicted step time and a predicted peak per device; the fastest that
    fits is chosen. ``optimizer_bytes_per_param``: the optimizer's state per
    trained element (8 for AdamW in float32). ``contention``: how much
    slower CPU stages run when all the pipe's CPU workers run at once
    (None: measured now, on the model; 1.0: each its own idle core).
    ``action_overhead``: seconds the library adds per action (None:
    measured now, with a pipe of tiny layers on ``devices``). The model:
    docs/plan.md.

    Example::

        plan = pipeline.plan(model, x, y, F.cross_entropy, devices=["cpu", "cpu"],
                             batch_size=len(x), memory_limit=2**30)
        print(plan)
        pipe = plan.pipe()
        pipe.step(x, y, F.cross_entropy, schedule=plan.schedule, measure_memory=True)
        print(plan.check(pipe))

    Raises ``PlanError`` when nothing fits, naming the device that overflows
    and by how much under the configuration that needs the least memory;
    ``TypeError`` or ``ValueError`` for bad arguments, before any work.
    """
    # With keywords, the first layer's call, as pipe.step makes it (no input: keywords alone).
    args = () if sample_input is None else (sample_input,)
    value = sample_input if not kwargs else Arguments(args, dict(kwargs))
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (output, target) -> loss, got {loss_fn!r}")
    sequential, resolved, size, limit, counts = check_plan_arguments(
        model,
        value,
        devices,
        batch_size,
        memory_limit,
        chunks,
        schedules,
        checkpoints,
        optimizer_bytes_per_param,
    )
    profiles: dict[int, tuple[Saved, LayerTimes]] = {}

    def first(m: int) -> tuple[Any, Any]:
        """The first of ``m`` micro-batches of the input and the target, as a step splits them."""
        return scatter(value, m)[0].value, scatter(target, m)[0].value

    def profiled(rows: int) -> tuple[Saved, LayerTimes]:
        if rows not in profiles:
            micro, aim = first(size // rows)
            profiles[rows] = (
                saved_storages(sequential, micro, aim, loss_fn, resolved[0]),
                layer_times(sequential, micro, aim, loss_fn, resolved[0], repeats),
            )
        return profiles[rows]

    if contention is None:
        workers = sum(d.type == "cpu" for d in resolved)
        micro, aim = first(counts[len(counts) // 2])
        contention = cpu_contention(sequential, micro, aim, loss_fn, workers, repeats)
    if action_overhead is None:
        action_overhead = measured_overhead(resolved, 8, repeats)
    found = candidates(
        len(sequential),
        resolved,
        size,
        limit,
        counts,
        tuple(schedules),
        tuple(checkpoints),
        profiled,
        layer_parameters(sequential, int(optimizer_bytes_per_param)),
        action_overhead,
        contention,
    )
    return choose(sequential, found, limit, contention, action_overhead)
