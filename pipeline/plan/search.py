"""The search: every schedule, micro-batch count and checkpoint mode, each with its best balance.

For each configuration the programs are made and validated once; the
balance comes from ``partition.fitting_balance`` with each stage's
predicted memory against its budget (a device's limit, split evenly among
the stages it holds), and the compute-only cut is tried too; where stages
share a place, every cut is walked for those whose places fit and compute
least and the one whose fullest place holds least (``partition.shared_balances``),
else the cut whose largest stage holds least is tried (the figures of
``PlanError`` when nothing fits). Each
balance tried becomes a ``Candidate``: its predicted step time (``timing``)
and each stage's memory (``memory``), summed per device. Planned for
processes, a stage's place is its process (``rank 0``, ...) rather than its
device, and the messages between processes cost what ``links.py`` says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

import torch

from pipeline.plan.contention import NO_CONTENTION, Contention
from pipeline.plan.held import PeakForms
from pipeline.plan.links import Link, cut_seconds
from pipeline.plan.memory import LayerParameters, StageMemory, stage_memory
from pipeline.plan.pace import SAME_PACE, Pace, paced_as, virtual_stages
from pipeline.plan.partition import (
    fitting_balance,
    least_memory_balance,
    least_peak_balance,
    shared_balances,
)
from pipeline.plan.profile import LayerTimes, Saved
from pipeline.plan.sharding import LayerCollectives, stage_collectives
from pipeline.plan.timing import predicted_seconds, stage_costs
from pipeline.step.actions import Action, Program
from pipeline.step.runner import checkpointed_tasks
from pipeline.step.schedules import resolve_schedule
from pipeline.step.simulate import validate

__all__ = ["Candidate", "Profiled", "candidates", "memory_of", "runs"]

# The profile of one micro-batch size: rows -> (saved storages, layer times).
Profiled = Callable[[int], tuple[Saved, LayerTimes]]


@dataclass(frozen=True)
class Candidate:
    """One configuration with its balance, and what the model predicts of it.

    ``devices[j]`` is stage ``j``'s device; ``places[j]`` where its memory
    counts against the limit (its process, ``rank 0``, when planned for
    processes; empty: its device); ``memory[j]`` its peak by term;
    ``device_bytes`` the sum of the peaks of each place's stages (a bound:
    their peaks need not coincide); ``seconds`` the predicted step time.
    """

    schedule: str
    chunks: int
    checkpoint: str
    balance: tuple[int, ...]
    devices: tuple[torch.device, ...]
    seconds: float
    memory: tuple[StageMemory, ...]
    limit: int
    places: tuple[str, ...] = ()

    @property
    def device_bytes(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        places = self.places or tuple(map(memory_of, self.devices))
        for place, stage in zip(places, self.memory, strict=True):
            totals[place] = totals.get(place, 0) + stage.total
        return totals

    @property
    def overflow(self) -> dict[str, int]:
        """Bytes over the limit, per device that overflows."""
        return {d: b - self.limit for d, b in self.device_bytes.items() if b > self.limit}

    @property
    def fits(self) -> bool:
        return not self.overflow

    def describe(self) -> str:
        """``1f1b, 4 chunks, except_last, balance [3, 3]``."""
        return (
            f"{self.schedule}, {self.chunks} chunks, {self.checkpoint}, "
            f"balance {list(self.balance)}"
        )


def candidates(
    layers: int,
    devices: list[torch.device],
    batch_size: int,
    limit: int,
    chunks: tuple[int, ...],
    schedules: tuple[str, ...],
    checkpoints: tuple[str, ...],
    profiled: Profiled,
    parameters: LayerParameters,
    overhead: float,
    contention: Mapping[int, Contention] | None = None,
    link: Link | None = None,
    paces: Mapping[tuple[str, int], Pace] | None = None,
    collectives: LayerCollectives | None = None,
) -> list[Candidate]:
    """Every configuration's candidates; an interleaved one only where it can run.

    ``contention``: by micro-batch count, how much slower CPU stages run
    while all compute (``contention.py``; None or a count missing: not at
    all); the balance takes it as a scale of their costs.
    ``link``: planned for processes, one per entry of ``devices`` (its
    device), stage ``j`` in process ``j % len(devices)`` and the messages
    between them costing what ``link`` says; None: stages of one process.
    ``paces``: by the schedule that measured it (``pace.paced_as``) and
    micro-batch count, the model's pace in the pipe (``pace.py``): every stage's
    costs scaled by its factor, its seconds outside the actions added to
    every step. ``collectives``: per layer, its FSDP2 unit's all-gather and
    reduce-scatter seconds in a step (stages sharded: ``sharding.py``).
    """
    found: list[Candidate] = []
    for name in schedules:
        virtual = virtual_stages(name)
        stages = len(devices) * virtual
        stage_devices = tuple(devices * virtual)
        places = tuple(
            f"rank {j % len(devices)}" if link is not None else memory_of(d)
            for j, d in enumerate(stage_devices)
        )
        share = [limit // places.count(p) for p in places]
        for m in chunks:
            if not runs(name, m, layers, len(devices)):
                continue
            contended = NO_CONTENTION if contention is None else contention.get(m, NO_CONTENTION)
            factor = [contended if d.type == "cpu" else NO_CONTENTION for d in stage_devices]
            pace = SAME_PACE if paces is None else paces.get((paced_as(name), m), SAME_PACE)
            saved, times = profiled(batch_size // m)
            programs = resolve_schedule(name).programs(m, stages)
            order = validate(programs, m, stages).one_thread_order
            for mode in checkpoints:
                checkpointed = checkpointed_tasks(programs, m, mode, training=True)  # type: ignore[arg-type]
                found += _balanced(
                    _Configuration(
                        name,
                        m,
                        mode,
                        stage_devices,
                        places,
                        share,
                        factor,
                        pace,
                        limit,
                        overhead,
                        link,
                        collectives,
                    ),
                    programs,
                    order,
                    checkpointed,
                    saved,
                    times,
                    parameters,
                    layers,
                )
    return found


def memory_of(device: torch.device) -> str:
    """The memory ``device`` draws on, by name: every CPU device draws on the host's
    (``cpu:0`` and ``cpu`` are one memory, which one limit bounds)."""
    return "cpu" if device.type == "cpu" else str(device)


def runs(schedule: str, chunks: int, layers: int, workers: int) -> bool:
    """Whether ``schedule`` can run ``chunks`` micro-batches of ``layers`` on ``workers``: the
    interleaved one needs two layers per worker and chunks a multiple of the workers
    (schedules.py)."""
    virtual = virtual_stages(schedule)
    return layers >= workers * virtual and not (virtual > 1 and chunks % workers)


@dataclass(frozen=True)
class _Configuration:
    """A schedule, a micro-batch count and a checkpoint mode, on stages' devices and budgets."""

    schedule: str
    chunks: int
    checkpoint: str
    devices: tuple[torch.device, ...]
    places: tuple[str, ...]
    share: list[int]
    factor: list[Contention]
    pace: Pace
    limit: int
    overhead: float
    link: Link | None
    collectives: LayerCollectives | None


def _balanced(
    config: _Configuration,
    programs: list[Program],
    order: Sequence[Action],
    checkpointed: set[tuple[int, int]],
    saved: Saved,
    times: LayerTimes,
    parameters: LayerParameters,
    layers: int,
) -> list[Candidate]:
    """The configuration with its balance that fits (if any) and its compute-only balance.

    ``order``: every stage's actions as one thread would run them, along
    which each stage's memory is walked (mail comes from its neighbours).
    """
    stages, m = len(config.devices), config.chunks
    recomputed = [sum((i, j) in checkpointed for i in range(m)) / m for j in range(stages)]
    figures = _Figures(order, checkpointed, saved, parameters, config.places, config.link)

    def cost(j: int, a: int, b: int) -> float:
        c = stage_costs(times, a, b, config.factor[j] * config.pace.scale)
        return c.forward * (1 + recomputed[j]) + c.backward

    def fits(j: int, a: int, b: int) -> bool:
        return figures.stage(j, a, b).total <= config.share[j]

    def total(j: int, a: int, b: int) -> int:
        return figures.stage(j, a, b).total

    def totals(spans: list[tuple[int, int]]) -> list[int]:
        return [stage.total for stage in figures.cut(spans)]

    tried = [
        fitting_balance(layers, stages, cost, fits),
        fitting_balance(layers, stages, cost, lambda j, a, b: True),
    ]
    shared = len(set(config.places)) < stages
    walked = None
    if shared or figures.whole_cut:  # what fits a sum, or figures of the whole cut
        walked = shared_balances(layers, stages, cost, totals, config.places, config.limit)
    if walked is not None:
        tried += [*walked[0], walked[1]]
    elif shared:
        tried.append(least_memory_balance(layers, stages, total))
    else:
        tried.append(least_peak_balance(layers, stages, total))  # for PlanError's figures
    cuts = {tuple(cut) for cut in tried if cut is not None}
    found = []
    for cut in sorted(cuts):
        spans = list(pairwise([0, *accumulate(cut)]))
        owner = [config.places.index(p) for p in config.places]
        seconds = config.pace.outside + predicted_seconds(
            programs,
            [stage_costs(times, a, b, config.pace.scale) for a, b in spans],
            checkpointed,
            config.overhead,
            config.factor,
            None if config.link is None else cut_seconds(saved, spans, owner, config.link),
            stage_collectives(config.collectives, spans),
        )
        found.append(
            Candidate(
                schedule=config.schedule,
                chunks=m,
                checkpoint=config.checkpoint,
                balance=cut,
                devices=config.devices,
                seconds=seconds,
                memory=figures.cut(spans),
                limit=config.limit,
                places=config.places if config.link is not None else (),
            )
        )
    return found


class _Figures:
    """Each stage's predicted memory (``memory.stage_memory``), remembered.

    Of a stage alone (``stage``: its layers), as the search's dynamic programs
    ask; and under a whole cut (``cut``), which moves it where ``whole_cut``:
    a skip comes from, and goes to, the stages of the cut (alone: the
    neighbours), and in processes (``link``) a weight tied between stages of
    one process is counted once there (alone: in every stage holding it).
    """

    def __init__(
        self,
        order: Sequence[Action],
        checkpointed: set[tuple[int, int]],
        saved: Saved,
        parameters: LayerParameters,
        places: tuple[str, ...],
        link: Link | None,
    ) -> None:
        self._order, self._checkpointed = order, checkpointed
        self._forms: dict[int, PeakForms] = {}  # each stage's walk, done once
        self._saved, self._parameters, self._places = saved, parameters, places
        # In processes, each stage holds its own copy of a tied weight.
        self._copies = link is not None
        self.whole_cut = bool(saved.skips) or (self._copies and parameters.tied)
        self._memo: dict[tuple[object, ...], StageMemory] = {}

    def stage(self, j: int, a: int, b: int) -> StageMemory:
        return self._remembered(j, a, b, None, frozenset() if self._copies else None)

    def cut(self, spans: list[tuple[int, int]]) -> tuple[StageMemory, ...]:
        if not self.whole_cut:
            return tuple(self.stage(j, a, b) for j, (a, b) in enumerate(spans))
        stage_of = _stage_of(spans)
        counted: dict[str, frozenset[int]] = {}
        found = []
        for j, (a, b) in enumerate(spans):
            held = self._parameters.holds(a, b)
            earlier = counted.get(self._places[j], frozenset())
            found.append(
                self._remembered(j, a, b, stage_of, earlier & held if self._copies else None)
            )
            counted[self._places[j]] = earlier | held
        return tuple(found)

    def _remembered(
        self,
        j: int,
        a: int,
        b: int,
        stage_of: Callable[[int], int] | None,
        counted: frozenset[int] | None,
    ) -> StageMemory:
        ends: tuple[tuple[int, ...], ...] = ()
        if stage_of is not None:  # what of the cut moves the figures: the skips' stages
            ends = (
                tuple(stage_of(s.stashed_by) for s in self._saved.skips_into(a, b)),
                tuple(stage_of(s.popped_by) for s in self._saved.skips_out_of(a, b)),
            )
        key = (j, a, b, ends, counted)
        if key not in self._memo:
            if j not in self._forms:
                self._forms[j] = PeakForms(self._order, j, self._checkpointed)
            self._memo[key] = stage_memory(
                self._forms[j],
                saved=self._saved,
                parameters=self._parameters,
                first=a,
                stop=b,
                stage_of=stage_of,
                counted=counted,
            )
        return self._memo[key]


def _stage_of(spans: list[tuple[int, int]]) -> Callable[[int], int]:
    """The stage holding each layer, under the cut of ``spans``."""
    stages = [j for j, (a, b) in enumerate(spans) for _ in range(a, b)]
    return stages.__getitem__
