"""``pipeline.plan``: choose a Pipe's balance, micro-batches, schedule and checkpointing.

Read in this order: ``profile.py`` (what is measured of the model, per
micro-batch size), ``memory.py`` and ``timing.py`` (the two models),
``links.py`` (what crosses between processes), ``sharding.py`` (stages
sharded with FSDP2), ``partition.py`` (the
balance for time and memory together), ``search.py`` (every
configuration), ``result.py`` (``Plan``, its table, ``pipe()``,
``distributed()``, ``check()``); ``agreement.py`` (one plan in every
process of a group). docs/plan.md writes the model down, with its measured
error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipeline.plan.agreement import agree_inputs, from_rank_zero
from pipeline.plan.checks import (
    CHECKPOINTS,
    SCHEDULES,
    check_measures,
    check_placement,
    check_plan_arguments,
    check_target_rows,
)
from pipeline.plan.contention import NO_CONTENTION, Contention, cpu_contention
from pipeline.plan.links import Link, measure_link
from pipeline.plan.memory import LayerParameters, layer_parameters
from pipeline.plan.overhead import action_overhead as measured_overhead
from pipeline.plan.overhead import distributed_action_overhead
from pipeline.plan.pace import Pace, Placement, Workload, measured_paces, paced_as
from pipeline.plan.profile import LayerTimes, Saved, layer_times, saved_storages
from pipeline.plan.result import Plan, PlanCheck, PlanError, Processes, choose
from pipeline.plan.search import Candidate, candidates, runs
from pipeline.plan.sharding import (
    LayerCollectives,
    Sharding,
    layer_collectives,
    measure_collectives,
    mesh_dimensions,
    refuse_unshardable,
    sharded_parameters,
)
from pipeline.runtime.microbatch import Arguments, scatter
from pipeline.runtime.process_group import collective_device, resolve_group

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Candidate", "Plan", "PlanCheck", "PlanError", "plan"]

# The micro-batches of the tiny pipe whose steps measure the cost of an action.
_OVERHEAD_CHUNKS = 8


def plan(
    model: nn.Sequential,
    sample_input: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    *,
    devices: Sequence[Any] | None = None,
    processes: int | None = None,
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
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    link_latency: float | None = None,
    link_seconds_per_byte: float | None = None,
    mesh: DeviceMesh | None = None,
) -> Plan:
    """The fastest predicted pipe configuration whose predicted peak fits ``memory_limit``.

    ``sample_input`` and ``target`` are one mini-batch of ``batch_size`` rows
    as ``pipe.step`` takes them (``kwargs``: the first layer's keyword
    arguments, split like the input), ``loss_fn`` the step's loss. Either
    ``devices``, one device per stage of a ``Pipe`` in this process, with
    ``memory_limit`` bytes per device (partitions sharing a device share
    it); or ``processes=N``, N stages of a ``DistributedPipe``, one process
    each (two with the interleaved schedule), with ``memory_limit`` bytes
    per process.

    Each layer is profiled once per micro-batch size (``repeats`` timed
    runs, medians), on ``devices[0]`` (or this process's device), on
    copies: the model is left as it was. Then every schedule of
    ``schedules`` x micro-batch count of ``chunks`` (default: the powers of
    two up to 32 dividing ``batch_size``) x checkpoint mode of
    ``checkpoints`` gets its balance for time and memory together, a
    predicted step time and a predicted peak per device or process; the
    fastest that fits is chosen. ``optimizer_bytes_per_param``: the
    optimizer's state per trained element (8 for AdamW in float32).
    ``contention``: how much slower CPU stages run when all the pipe's CPU
    workers run at once (None: measured now, on the model, for forwards and
    backwards apart; a number: both; 1.0: each its own idle core). None, on
    devices or for processes in a group, measures the model's pace in the
    pipe itself instead, for each count (``pace.py``); a contention is then
    measured only for processes planned outside a group.
    ``action_overhead``: seconds the library adds per action (None: measured
    now, with a pipe of tiny layers). The model: docs/plan.md.

    With ``processes``, every process of ``group`` (default: the default
    group, of N processes) calls ``plan`` with the same arguments, and gets
    the same plan: what each computes exactly is compared first (every
    process raises on a difference), the layers are timed on rank 0 and the
    other measurements agreed (``agreement.py``). ``device``: this
    process's (default: as DistributedPipe's, the current CUDA device with
    NCCL, else the CPU). A message between processes is taken to cost
    ``link_latency + bytes * link_seconds_per_byte`` seconds (None:
    measured in the group, ``links.py``). Outside a process group, give
    both, and ``action_overhead``.

    With ``mesh``, a ``(dp, pp)`` ``DeviceMesh`` (dimensions named "dp"
    and "pp"), the pipeline runs on "pp" (``processes`` is its size) and
    each stage is sharded with FSDP2 over "dp" (``sharding.py``): each
    data-parallel replica steps on its own ``batch_size`` rows, and
    ``memory_limit`` bounds each process with its shard. Every process of
    the mesh calls ``plan``; the replicas measure side by side, as they will
    train, and take the first replica's figures, so that all choose alike;
    ``plan.distributed()`` builds and shards this process's stages.

    Example::

        plan = pipeline.plan(model, x, y, F.cross_entropy, devices=["cpu", "cpu"],
                             batch_size=len(x), memory_limit=2**30)
        print(plan)
        pipe = plan.pipe()  # or, planned with processes=N in every process: plan.distributed()
        pipe.step(x, y, F.cross_entropy, schedule=plan.schedule, measure_memory=True)
        print(plan.check(pipe))

    Raises ``PlanError`` when nothing fits, naming the device or process
    that overflows and by how much under the configuration that needs the
    least memory; ``TypeError`` or ``ValueError`` for bad arguments, before
    any work (in every process, with ``processes``).
    """
    # With keywords, the first layer's call, as pipe.step makes it (no input: keywords alone).
    args = () if sample_input is None else (sample_input,)
    value = sample_input if not kwargs else Arguments(args, dict(kwargs))
    in_group = group is not None or (dist.is_available() and dist.is_initialized())
    shards = 1
    if mesh is not None:
        if group is not None:
            raise TypeError(
                "pass mesh= or group=, not both: the mesh's 'pp' dimension is the group"
            )
        processes, shards = mesh_dimensions(mesh, processes)
        group = mesh["pp"].get_group()
    # In a group every process compares its arguments, a refusing one too: the others wait.
    pg = resolve_group(group) if processes is not None and in_group else None
    replicas = None if mesh is None else mesh["dp"].get_group()
    profiles: dict[int, tuple[Saved, LayerTimes]] = {}
    refusal: Exception | None = None
    try:
        count = check_placement(
            devices, processes, link_latency, link_seconds_per_byte, in_group, action_overhead
        )
        check_measures(repeats, action_overhead, contention)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (output, target) -> loss, got {loss_fn!r}")
        here = None if count is None else _process_device(pg, device)
        placed = [here] * count if here is not None and count is not None else devices
        sequential, resolved, size, limit, counts = check_plan_arguments(
            model,
            value,
            placed or (),
            batch_size,
            memory_limit,
            chunks,
            schedules,
            checkpoints,
            optimizer_bytes_per_param,
            what="devices" if here is None else "processes",
        )
        check_target_rows(target, size)
        if mesh is not None:
            refuse_unshardable(sequential)
        if pg is not None and dist.get_world_size(pg) != count:
            raise ValueError(
                f"processes={count} but the process group has {dist.get_world_size(pg)} "
                "processes: a DistributedPipe runs one stage per process of its group; pass "
                f"processes={dist.get_world_size(pg)}, or a group of {count} processes"
            )
    except Exception as error:
        if pg is None:
            raise
        refusal = error

    def first(m: int) -> tuple[Any, Any]:
        """The first of ``m`` micro-batches of the input and the target, as a step splits them."""
        return scatter(value, m)[0].value, scatter(target, m)[0].value

    # A Pipe seeds each random op of partitions that share the CPU's generator across
    # threads (runtime/ownership.py); a DistributedPipe's process owns its generators.
    seeded = pg is None and count is None and sum(d.type == "cpu" for d in resolved) > 1

    def timed(rows: int) -> LayerTimes:
        micro, aim = first(size // rows)
        return layer_times(sequential, micro, aim, loss_fn, resolved[0], repeats, seeded)

    def profiled(rows: int) -> tuple[Saved, LayerTimes]:
        if rows not in profiles:
            micro, aim = first(size // rows)
            saved = saved_storages(sequential, micro, aim, loss_fn, resolved[0])
            profiles[rows] = (saved, timed(rows))
        return profiles[rows]

    if pg is not None:
        # Every process's own profile of saved bytes, compared; the times are rank 0's.
        saved: dict[int, Saved] = {}
        if refusal is None:
            try:
                for m in counts:
                    micro, aim = first(m)
                    saved[size // m] = saved_storages(sequential, micro, aim, loss_fn, resolved[0])
            except Exception as error:
                refusal = error
        compared = [
            processes, batch_size, memory_limit, chunks, schedules, checkpoints,
            optimizer_bytes_per_param, repeats, action_overhead, contention, link_latency,
            link_seconds_per_byte, None if here is None else here.type, model, saved, shards,
        ]  # fmt: skip
        agree_inputs(pg, refusal, repr(compared), replicas)
        for rows, memory in saved.items():
            times = _from_rank_zero(pg, rows, len(sequential) + 1, timed, replicas)
            profiles[rows] = (memory, times)

    link = None if count is None else _link(pg, link_latency, link_seconds_per_byte, repeats)
    sharding = None
    if mesh is not None and pg is not None:
        sharding = Sharding(mesh, measure_collectives(pg, mesh, repeats))
    collectives = None if sharding is None else layer_collectives(sequential, sharding.collectives)

    def contended(m: int) -> Contention:
        """The contention among the workers with ``m`` micro-batches: the smaller they are,
        the more of a seeded forward is Python, and the longer the workers wait for its lock."""
        if contention is not None:
            return Contention(contention, contention)
        if where is not None:
            return NO_CONTENTION  # the pace measured in the pipe holds it (pace.py)
        micro, aim = first(m)
        workers = sum(d.type == "cpu" for d in resolved)
        return cpu_contention(sequential, micro, aim, loss_fn, workers, repeats, seeded)

    # Where the pace is measured: a Pipe on the devices, or a DistributedPipe of the group;
    # nowhere for processes outside a group, or where a contention was given.
    where = None
    if contention is None and count is None:
        where = Placement(tuple(resolved))
    elif contention is None and pg is not None:
        where = Placement((resolved[0],), pg, None if mesh is None else mesh["dp"])

    factors = {m: contended(m) for m in counts}
    if action_overhead is None:
        if pg is None or link is None:  # outside a group, check_placement wanted it given
            action_overhead = measured_overhead(resolved, _OVERHEAD_CHUNKS, repeats)
        else:
            action_overhead = distributed_action_overhead(
                pg, resolved[0], link, _OVERHEAD_CHUNKS, repeats
            )
    paces = _paces(
        where, Workload(sequential, sample_input, target, loss_fn, kwargs), schedules, counts,
        lambda m: profiled(size // m), link, action_overhead, repeats, collectives,
    )  # fmt: skip
    if replicas is not None:
        # The replicas measured side by side: the first one's figures, in every process.
        link, action_overhead, paces = _as_first_replica(replicas, link, action_overhead, paces)
    found = candidates(
        len(sequential),
        resolved,
        size,
        limit,
        counts,
        tuple(schedules),
        tuple(checkpoints),
        profiled,
        _parameters(sequential, int(optimizer_bytes_per_param), shards, mesh is not None),
        action_overhead,
        factors,
        link,
        paces,
        collectives,
    )  # fmt: skip
    placement = None
    if count is not None and link is not None:
        placement = Processes(count, pg, resolved[0], link, sharding)
    return choose(sequential, found, limit, factors, action_overhead, placement, paces)


def _parameters(
    model: nn.Sequential, optimizer_bytes_per_param: int, shards: int, sharded: bool
) -> LayerParameters:
    """Each layer's parameter terms: ``sharded`` ``shards`` ways (over one shard too, a unit
    gathers its parameters and reduces its gradients into copies of them), else whole."""
    if not sharded:
        return layer_parameters(model, optimizer_bytes_per_param)
    return sharded_parameters(model, optimizer_bytes_per_param, shards)


def _as_first_replica(
    replicas: dist.ProcessGroup,
    link: Link | None,
    overhead: float,
    paces: dict[tuple[str, int], Pace] | None,
) -> tuple[Link | None, float, dict[tuple[str, int], Pace] | None]:
    """The link, the cost of an action and the paces of the first replica (rank 0 of
    ``replicas``), the same in every replica."""
    keys = sorted(paces or {})
    mine = [] if link is None else [link.latency, link.seconds_per_byte]
    mine += [overhead]
    mine += [n for key in keys for n in (paces[key].factor, paces[key].outside)] if paces else []
    first = iter(from_rank_zero(replicas, len(mine), lambda: mine))
    if link is not None:
        link = Link(next(first), next(first))
    overhead = next(first)
    if paces is not None:
        paces = {key: Pace(next(first), next(first)) for key in keys}
    return link, overhead, paces


def _paces(
    where: Placement | None,
    work: Workload,
    schedules: Sequence[str],
    counts: Sequence[int],
    profiled: Callable[[int], tuple[Saved, LayerTimes]],
    link: Link | None,
    overhead: float,
    repeats: int,
    collectives: LayerCollectives | None,
) -> dict[tuple[str, int], Pace] | None:
    """The model's pace in a pipe placed ``where`` (``pace.py``), by the schedule that
    measures it (``paced_as``) and micro-batch count, for each the schedules can run;
    None where it is not measured."""
    if where is None:
        return None
    names = sorted({paced_as(s) for s in schedules})
    wanted = [
        (name, m, profiled(m))
        for name in names
        for m in counts
        if runs(name, m, len(work.model), where.workers)
    ]
    paces = measured_paces(where, work, wanted, link, overhead, repeats, collectives)
    return {(name, m): p for (name, m, _), p in zip(wanted, paces, strict=True)}


def _link(
    group: dist.ProcessGroup | None,
    latency: float | None,
    seconds_per_byte: float | None,
    repeats: int,
) -> Link:
    """The link given, else measured in ``group`` (check_placement wanted one or the other)."""
    if latency is not None and seconds_per_byte is not None:
        return Link(float(latency), float(seconds_per_byte))
    assert group is not None, "outside a group, check_placement refused a plan without a link"
    return measure_link(group, repeats)


def _process_device(
    group: dist.ProcessGroup | None, device: torch.device | str | None
) -> torch.device:
    """This process's device: the one given, else a DistributedPipe's default (or the CPU)."""
    if device is not None:
        return torch.device(device)
    return collective_device(group) if group is not None else torch.device("cpu")


def _from_rank_zero(
    group: dist.ProcessGroup,
    rows: int,
    width: int,
    timed: Callable[[int], LayerTimes],
    replicas: dist.ProcessGroup | None = None,
) -> LayerTimes:
    """``timed(rows)`` on rank 0 (``width`` layers and the loss), the same on every rank;
    with ``replicas``, the first replica's rank 0's: the pace's pipes are cut by these
    times, and the replicas' pipes, sharded together, must be cut alike."""

    def flat() -> list[float]:
        times = timed(rows)
        return [*times.forward, *times.backward, *times.input_grad]

    numbers = from_rank_zero(group, 3 * width, flat)
    if replicas is not None:
        numbers = from_rank_zero(replicas, 3 * width, lambda: numbers)
    return LayerTimes(*(tuple(numbers[k * width : (k + 1) * width]) for k in range(3)))
