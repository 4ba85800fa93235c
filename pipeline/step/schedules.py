"""Explicit schedules for ``Pipe.step``: which actions each worker runs, in which order.

A schedule turns ``m`` micro-batches over ``n`` stages (the Pipe's
partitions) into one program per worker (``actions.py``). Stage ``s`` runs on
worker ``s % workers``; all schedules but the interleaved one have a worker
per stage. Costs below are in units of one forward (F = 1, B = 2)::

    GPipe   0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0     all forwards, then all backwards:
                                                m micro-batches in flight per stage
    1F1B    0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3     after n - s warm-up forwards, one
                                                forward per backward: at most n - s
                                                in flight on stage s, same bubble
    interleaved (v stages per worker)            Megatron's order over v * workers
                                                stages: the bubble shrinks by v
    ZB-H1   0F0 0F1 0I0 0W0 0F2 0I1 0W1 ...     1F1B with each backward split into I
                                                (input) and W (weight): W fills the
                                                gaps, a forward waits for a W, so at
                                                most n - s in flight (1F1B's memory)

Every program is checked by ``simulate.validate`` before it runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal

from pipeline.step.actions import Action, Kind, Program, parse_program

__all__ = [
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "Programs",
    "Schedule",
    "ZeroBubbleH1",
    "ZeroBubbleMemory",
    "forwards_in_order",
    "resolve_schedule",
]


class Schedule(ABC):
    """Makes the programs of ``workers`` workers for ``m`` micro-batches over ``stages`` stages."""

    name: str = "schedule"

    def workers(self, stages: int) -> int:
        """How many workers run the ``stages`` stages (one each, unless interleaved)."""
        return stages

    @abstractmethod
    def programs(self, m: int, stages: int) -> list[Program]: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GPipe(Schedule):
    """Every forward, then every backward, last micro-batch first, on each stage.

    The backward order is ``pipe(x)``'s: the last micro-batch's backward
    follows its forward at once.

    >>> [" ".join(map(str, p)) for p in GPipe().programs(2, 2)]
    ['0F0 0F1 0B1 0B0', '1F0 1F1 1B1 1B0']
    """

    name = "gpipe"

    def programs(self, m: int, stages: int) -> list[Program]:
        return [
            [Action(s, "F", i) for i in range(m)] + [Action(s, "B", i) for i in reversed(range(m))]
            for s in range(stages)
        ]


class OneFOneB(Schedule):
    """One forward, one backward: stage ``s`` holds at most ``stages - s`` micro-batches.

    >>> [" ".join(map(str, p)) for p in OneFOneB().programs(4, 2)]
    ['0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3', '1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3']
    """

    name = "1f1b"

    def programs(self, m: int, stages: int) -> list[Program]:
        return [_one_f_one_b(s, m, stages, backward=["B"]) for s in range(stages)]


ZeroBubbleMemory = Literal["stage", "peak"]


class ZeroBubbleH1(Schedule):
    """1F1B's memory (each stage's, or its peak), with backward split into I and W.

    I: the input gradient; W: the weight gradient.

    The programs come from playing the dependencies with unit costs (F, I, W
    = 1): a worker runs an input gradient as soon as it can (it is on the
    critical path back to stage 0), else a forward, while it holds fewer
    micro-batches whose weight gradient is still to come than ``memory``
    allows (a graph waiting for W is held as much as one waiting for I),
    else a weight gradient: the weight work fills the gaps where 1F1B waits.

    ``memory="stage"`` (the default): stage ``s`` never holds more than
    1F1B's ``min(stages - s, m)``, every stage at 1F1B's memory.
    ``memory="peak"`` (``"zb-h1-peak"``): every stage may hold 1F1B's largest count, the first
    stage's ``min(stages, m)``: the pipeline's peak stays 1F1B's, and the
    later stages hold more to fill more of their bubble (the zero-bubble
    paper's bound; torch's zero-bubble schedule holds as much). With unit
    costs, 2 stages and 4 micro-batches: 1F1B 15, ``"stage"`` 14, ``"peak"``
    13; 4 stages and 4 micro-batches: 21, 18, 15.

    >>> [" ".join(map(str, p)) for p in ZeroBubbleH1().programs(3, 2)]
    ['0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2', '1F0 1I0 1W0 1F1 1I1 1W1 1F2 1I2 1W2']
    >>> [" ".join(map(str, p)) for p in ZeroBubbleH1(memory="peak").programs(3, 2)]
    ['0F0 0F1 0I0 0W0 0I1 0F2 0W1 0I2 0W2', '1F0 1I0 1F1 1I1 1W0 1W1 1F2 1I2 1W2']
    """

    def __init__(self, memory: ZeroBubbleMemory = "stage") -> None:
        if memory not in ("stage", "peak"):
            raise ValueError(
                f"memory must be 'stage' (each stage at 1F1B's memory) or 'peak' (each stage "
                f"at 1F1B's peak, the first stage's), got {memory!r}"
            )
        self.memory = memory
        self.name = "zb-h1" if memory == "stage" else "zb-h1-peak"

    def programs(self, m: int, stages: int) -> list[Program]:
        if self.memory == "stage":
            return _zero_bubble_programs(m, stages, [stages - s for s in range(stages)])
        return _zero_bubble_programs(m, stages, [stages] * stages)

    def __repr__(self) -> str:
        return "ZeroBubbleH1()" if self.memory == "stage" else "ZeroBubbleH1(memory='peak')"


class Interleaved1F1B(Schedule):
    """Megatron's interleaved 1F1B: ``virtual`` stages per worker, stage ``s`` on worker ``s % W``.

    Needs the number of micro-batches to be a multiple of the number of
    workers, as Megatron does.
    """

    name = "interleaved"

    def __init__(self, virtual: int = 2) -> None:
        if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
            raise ValueError(f"virtual must be a positive int (stages per worker), got {virtual!r}")
        self.virtual = virtual

    def workers(self, stages: int) -> int:
        if stages % self.virtual:
            raise ValueError(
                f"the interleaved schedule with virtual={self.virtual} runs {self.virtual} stages "
                f"per worker, but the Pipe has {stages} partitions; use a balance whose length "
                f"is a multiple of {self.virtual}"
            )
        return stages // self.virtual

    def programs(self, m: int, stages: int) -> list[Program]:
        workers = self.workers(stages)
        if m % workers:
            raise ValueError(
                f"the interleaved schedule needs the number of micro-batches ({m}) to be a "
                f"multiple of the number of workers ({workers}); change chunks (or the batch "
                "size, when it gives fewer micro-batches than chunks)"
            )
        total = m * self.virtual
        programs = []
        for w in range(workers):
            warmup = min((workers - w - 1) * 2 + (self.virtual - 1) * workers, total)
            forwards = [self._action(w, workers, k, "F") for k in range(total)]
            backwards = [self._action(w, workers, k, "B") for k in range(total)]
            program = forwards[:warmup]
            for k in range(total - warmup):
                program += [forwards[warmup + k], backwards[k]]
            program += backwards[total - warmup :]
            programs.append(program)
        return programs

    def _action(self, w: int, workers: int, k: int, kind: Kind) -> Action:
        """The ``k``-th forward (or backward) of worker ``w`` in Megatron's order."""
        chunk = (k // workers) % self.virtual
        if kind == "B":
            chunk = self.virtual - 1 - chunk
        microbatch = (k // (workers * self.virtual)) * workers + k % workers
        return Action(chunk * workers + w, kind, microbatch)

    def __repr__(self) -> str:
        return f"Interleaved1F1B(virtual={self.virtual})"


class Programs(Schedule):
    """Programs written out: one list of actions (or one string such as "0F0 0B0") per worker.

    >>> Programs(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]).workers(2)
    2
    """

    name = "custom"

    def __init__(self, programs: Sequence[str | Sequence[str | Action]]) -> None:
        self._programs = [parse_program(p) for p in programs]

    def workers(self, stages: int) -> int:
        return len(self._programs)

    def programs(self, m: int, stages: int) -> list[Program]:
        return [list(program) for program in self._programs]

    def __repr__(self) -> str:
        return f"Programs({[' '.join(map(str, p)) for p in self._programs]})"


def _one_f_one_b(s: int, m: int, stages: int, backward: list[Kind]) -> Program:
    """Stage ``s``'s 1F1B order, each backward written as the actions of kinds ``backward``."""
    warmup = min(stages - 1 - s, m)
    order = [("F", i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(m - warmup, m)]
    program: Program = []
    for kind, i in order:
        kinds: list[Kind] = ["F"] if kind == "F" else backward
        program += [Action(s, k, i) for k in kinds]
    return program


def _zero_bubble_programs(m: int, stages: int, held: list[int]) -> list[Program]:
    """ZB-H1's programs: a list schedule of the dependencies with unit costs (see the class).

    Stage ``s`` runs a forward only while it holds fewer than ``held[s]``
    micro-batches whose weight gradient is still to come.
    """
    clock = [0.0] * stages
    forwarded: dict[tuple[int, int], float] = {}
    input_grads: dict[tuple[int, int], float] = {}
    counts: list[dict[Kind, int]] = [{"F": 0, "I": 0, "W": 0} for _ in range(stages)]
    programs: list[Program] = [[] for _ in range(stages)]

    def options(s: int) -> list[tuple[float, int, Kind]]:
        """(earliest start, priority, kind) of what stage ``s`` could run next."""
        done = counts[s]
        found: list[tuple[float, int, Kind]] = []
        if done["I"] < done["F"]:
            i = done["I"]
            ready = forwarded.get((s, i)) if s == stages - 1 else input_grads.get((s + 1, i))
            if ready is not None:
                found.append((max(clock[s], ready), 0, "I"))
        if done["F"] < m and done["F"] - done["W"] < held[s]:
            ready = 0.0 if s == 0 else forwarded.get((s - 1, done["F"]))
            if ready is not None:
                found.append((max(clock[s], ready), 1, "F"))
        if done["W"] < done["I"]:
            found.append((clock[s], 2, "W"))
        return found

    while any(counts[s]["W"] < m for s in range(stages)):
        start, _, s, kind = min(
            (start, priority, s, kind)
            for s in range(stages)
            for start, priority, kind in options(s)
        )
        i = counts[s][kind]
        counts[s][kind] += 1
        clock[s] = start + 1.0
        programs[s].append(Action(s, kind, i))
        if kind == "F":
            forwarded[s, i] = clock[s]
        elif kind == "I":
            input_grads[s, i] = clock[s]
    return programs


_BY_NAME: dict[str, Callable[[], Schedule]] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved": Interleaved1F1B,
    "zb-h1": ZeroBubbleH1,
    "zb-h1-peak": partial(ZeroBubbleH1, memory="peak"),
}


def forwards_in_order(schedule: Schedule) -> bool:
    """Whether ``schedule`` is a built-in one, whose programs run each stage's forwards in
    micro-batch order (not ``Programs`` nor a schedule of one's own: they may not)."""
    return type(schedule) in (GPipe, OneFOneB, ZeroBubbleH1, Interleaved1F1B)


def resolve_schedule(schedule: str | Schedule) -> Schedule:
    """The schedule named ``schedule`` (a key of ``_BY_NAME``), or itself.

    >>> resolve_schedule("zb-h1-peak")
    ZeroBubbleH1(memory='peak')
    """
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str) and schedule.lower() in _BY_NAME:
        return _BY_NAME[schedule.lower()]()
    raise ValueError(
        f"schedule must be one of {', '.join(map(repr, _BY_NAME))} or a Schedule (such as "
        f"pipeline.schedules.Programs([...]) for programs of your own), got {schedule!r}"
    )
