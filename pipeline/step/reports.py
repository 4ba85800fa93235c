"""What a step ran, measured: ``pipe.last_step``.

Each action of the step is timed where it runs: its start and end, and
within it the time it waited for its messages (an activation, a gradient, a
skip) and the time it spent recomputing. So a partition's time splits into::

    busy      its actions, less their waits: computing
    waiting   inside its actions, for a message from another stage
    idle      its worker in no action at all (between actions, or done early)

Times are seconds from the step's first action (``time.perf_counter``, the
host's clock: on CUDA an action ends when its kernels are queued). A
``DistributedPipe`` reports only this process's stages, on this process's
clock. Activation memory is measured only when asked
(``step(..., measure_memory=True)``): see ``activations.py``. A step keeps its
actions' times as taken; the report sums them when it is first read, so a
step whose report nobody reads pays nothing for it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from pipeline.step.actions import Action, Program
from pipeline.step.schedules import Schedule
from pipeline.step.simulate import Idle, Simulation

__all__ = [
    "ActionRecord",
    "DistributedStepReport",
    "Measured",
    "PartitionReport",
    "StepReport",
    "measure",
]


@dataclass(frozen=True)
class ActionRecord:
    """One action as it ran: seconds from the step's first action.

    ``waited`` is the time it spent waiting for its messages and
    ``recomputed`` the time a backward spent recomputing a checkpointed
    forward; ``worker`` is the worker (a ``Pipe``'s thread, a
    ``DistributedPipe``'s rank) that ran it.
    """

    action: Action
    worker: int
    start: float
    end: float
    waited: float
    recomputed: float

    @property
    def compute(self) -> float:
        """The action's time less its waits."""
        return self.end - self.start - self.waited

    def __str__(self) -> str:
        return (
            f"{self.action} {self.start * 1e3:.2f}..{self.end * 1e3:.2f} ms, "
            f"waited {self.waited * 1e3:.2f} ms"
        )


@dataclass(frozen=True)
class PartitionReport:
    """One partition's share of the step, in seconds.

    ``busy`` is the time its actions computed, ``waiting`` the time they
    waited for messages, ``idle`` the time its worker ran no action (shared
    by the partitions of one worker, with the interleaved schedule).
    ``time_by_kind`` splits ``busy`` by action kind (``"F"``, ``"B"``,
    ``"I"``, ``"W"``), and gives the recomputation inside backward as
    ``"R"``. ``peak_activation_bytes`` is None unless memory was measured.
    """

    partition: int
    worker: int
    busy: float
    waiting: float
    idle: float
    time_by_kind: dict[str, float]
    peak_in_flight: int
    peak_activation_bytes: int | None = None


class _Readable:
    """The one-line repr and the table of a report: the fields every report has."""

    schedule: Schedule
    simulation: Simulation
    measured: Measured

    @property
    def simulated_idle(self) -> Idle:
        """The schedule's idle shares, simulated on the workers the step ran on."""
        return self.simulation.idle_on(self.measured.programs, self.measured.worker_of_program)

    @property
    def duration(self) -> float:
        """Seconds from the step's first action's start to its last action's end."""
        return self.measured.result[0]

    @property
    def actions(self) -> tuple[ActionRecord, ...]:
        """Every action as it ran, in order of start."""
        return self.measured.result[1]

    @property
    def partitions(self) -> tuple[PartitionReport, ...]:
        """A report per partition (of this process, for a ``DistributedPipe``)."""
        return self.measured.result[2]

    def _shares(self) -> tuple[float, float, float]:
        """Busy, waiting and idle as shares of the workers' time (each worker once)."""
        workers: dict[int, float] = {}
        busy = waiting = 0.0
        for p in self.partitions:
            busy += p.busy
            waiting += p.waiting
            workers[p.worker] = p.idle
        whole = self.duration * len(workers)
        if whole <= 0:
            return 0.0, 0.0, 0.0
        return busy / whole, waiting / whole, sum(workers.values()) / whole

    def _summary(self) -> str:
        busy, waiting, idle = self._shares()
        m = 1 + max((r.action.microbatch for r in self.actions), default=-1)
        text = (
            f"{self.schedule!r}, {m} micro-batches x {len(self.simulation.peak_in_flight)} "
            f"partitions, {self.duration * 1e3:.1f} ms: busy {busy:.0%}, waiting {waiting:.0%}, "
            f"idle {idle:.0%} (simulated idle {self.simulated_idle.workers:.0%})"
        )
        measured = [p.peak_activation_bytes for p in self.partitions]
        if measured and all(b is not None for b in measured):
            summed = _bytes(sum(b or 0 for b in measured))
            text += f", activations {summed} (partitions' peaks summed)"
        return text

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._summary()})"

    def table(self) -> str:
        """A row per partition: time per kind, busy, waiting and idle, peaks.

        Example: ``print(pipe.last_step.table())``.
        """
        kinds = [k for k in "FBIWR" if any(p.time_by_kind.get(k) for p in self.partitions)]
        head = ["part", "worker", *(f"{k} ms" for k in kinds), "busy", "waiting", "idle"]
        head += ["peak mb", "activations"]
        rows = [head]
        for p in self.partitions:
            shares = [
                f"{t / self.duration:.0%}" if self.duration > 0 else "-"
                for t in (p.busy, p.waiting, p.idle)
            ]
            rows.append(
                [
                    str(p.partition),
                    str(p.worker),
                    *(f"{p.time_by_kind.get(k, 0.0) * 1e3:.2f}" for k in kinds),
                    *shares,
                    str(p.peak_in_flight),
                    "-" if p.peak_activation_bytes is None else _bytes(p.peak_activation_bytes),
                ]
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(head))]
        lines = [
            "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        return "\n".join([repr(self), *lines])


@dataclass(frozen=True, repr=False)
class StepReport(_Readable):
    """What the last ``Pipe.step`` ran: its schedule, the simulation, every action, measured.

    ``actions`` lists every action as it ran (``ActionRecord``), in order of
    start; ``partitions`` sums them per partition (``PartitionReport``).
    ``peak_in_flight[j]`` is the most micro-batches partition ``j`` held at
    once (forwarded, not yet fully back-propagated), as measured; it equals
    ``simulation.peak_in_flight`` for every valid program. ``repr()`` is one
    line; ``table()`` a row per partition. ``call_duration``: the seconds
    the ``step`` call took, ``duration`` and what comes before and after
    the actions (the batch's split into micro-batches, the loss's sum).
    """

    schedule: Schedule
    simulation: Simulation
    measured: Measured
    call_duration: float = 0.0

    @property
    def peak_in_flight(self) -> list[int]:
        return [p.peak_in_flight for p in self.partitions]


@dataclass(frozen=True, repr=False)
class DistributedStepReport(_Readable):
    """What this process ran in the last step: its stages' actions, on its clock.

    As ``StepReport``, for this process's stages only; ``peak_in_flight``
    maps each of them to the most micro-batches it held. ``received`` counts
    the messages that came from each peer, by kind (``"act"``, ``"grad"``,
    ``"skip"``, ``"skip-grad"``): ``{(rank, kind): count}``.
    ``call_duration``: the seconds the ``step`` call took in this process,
    ``duration`` and what comes before and after the actions: the
    processes' agreement on the step, the tied weights' sums, the loss's
    broadcast.
    """

    schedule: Schedule
    simulation: Simulation
    measured: Measured
    rank: int
    received: dict[tuple[int, str], int] = field(default_factory=dict)
    call_duration: float = 0.0

    @property
    def peak_in_flight(self) -> dict[int, int]:
        return {p.partition: p.peak_in_flight for p in self.partitions}

    def __repr__(self) -> str:
        count = sum(self.received.values())
        return (
            f"{type(self).__name__}(rank {self.rank}: {self._summary()}; received {count} messages)"
        )


@dataclass(slots=True)
class Timed:
    """An action's times as its stage took them (``time.perf_counter`` seconds)."""

    action: Action
    start: float
    end: float
    waited: float
    recomputed: float


class Measured:
    """A step's actions as timed, and ``measure``'s result of them, taken when first read.

    ``programs[k]`` ran on worker ``worker_of_program[k]`` (a thread, or a
    process's rank; by default ``k``); ``peak_in_flight`` and
    ``activations`` are as for ``measure``.
    """

    def __init__(
        self,
        timed: list[Timed],
        programs: list[Program],
        peak_in_flight: dict[int, int],
        activations: dict[int, int | None],
        worker_of_program: Sequence[int] | None = None,
    ) -> None:
        self._timed = timed
        self.programs = programs
        self.worker_of_program = (
            list(range(len(programs))) if worker_of_program is None else list(worker_of_program)
        )
        self._peak_in_flight = peak_in_flight
        self._activations = activations

    @cached_property
    def result(self) -> tuple[float, tuple[ActionRecord, ...], tuple[PartitionReport, ...]]:
        """The step's duration, its actions and its partitions' reports (``measure``)."""
        worker_of = {
            a.stage: self.worker_of_program[k]
            for k, program in enumerate(self.programs)
            for a in program
        }
        return measure(self._timed, worker_of, self._peak_in_flight, self._activations)


def measure(
    timed: Iterable[Timed],
    worker_of: dict[int, int],
    peak_in_flight: dict[int, int],
    activations: dict[int, int | None],
) -> tuple[float, tuple[ActionRecord, ...], tuple[PartitionReport, ...]]:
    """The step's duration, its actions from its first start, and a report per partition.

    ``worker_of`` maps each partition to its worker; ``peak_in_flight`` and
    ``activations`` (peak bytes, or None) give each partition's peaks.

    >>> a = Timed(Action(0, "F", 0), 10.0, 10.5, 0.0, 0.0)
    >>> b = Timed(Action(1, "F", 0), 10.0, 11.0, 0.5, 0.0)
    >>> duration, _, parts = measure([a, b], {0: 0, 1: 1}, {0: 1, 1: 1}, {0: None, 1: None})
    >>> duration, [(p.busy, p.waiting, p.idle) for p in parts]
    (1.0, [(0.5, 0.0, 0.5), (0.5, 0.5, 0.0)])
    """
    ordered = sorted(timed, key=lambda t: t.start)
    if not ordered:
        return 0.0, (), ()
    origin = ordered[0].start
    duration = max(t.end for t in ordered) - origin
    actions = tuple(
        ActionRecord(
            t.action,
            worker_of[t.action.stage],
            t.start - origin,
            t.end - origin,
            t.waited,
            t.recomputed,
        )
        for t in ordered
    )
    in_actions: dict[int, float] = defaultdict(float)
    for record in actions:
        in_actions[record.worker] += record.end - record.start
    partitions = tuple(
        _partition(
            [r for r in actions if r.action.stage == j],
            PartitionReport(
                j,
                worker_of[j],
                busy=0.0,
                waiting=0.0,
                idle=max(duration - in_actions[worker_of[j]], 0.0),
                time_by_kind={},
                peak_in_flight=peak_in_flight[j],
                peak_activation_bytes=activations.get(j),
            ),
        )
        for j in sorted(peak_in_flight)
    )
    return duration, actions, partitions


def _partition(records: Sequence[ActionRecord], empty: PartitionReport) -> PartitionReport:
    """``empty`` with the busy and waiting time of ``records``, and busy time per kind."""
    time_by_kind: dict[str, float] = {}
    for r in records:
        time_by_kind[r.action.kind] = time_by_kind.get(r.action.kind, 0.0) + r.compute
        if r.recomputed:
            time_by_kind["R"] = time_by_kind.get("R", 0.0) + r.recomputed
    return replace(
        empty,
        busy=sum(r.compute for r in records),
        waiting=sum(r.waited for r in records),
        time_by_kind=time_by_kind,
    )


def _bytes(count: int) -> str:
    """``1.5 KiB``: a byte count for people.

    >>> _bytes(512), _bytes(1536), _bytes(3 * 2**20)
    ('512 B', '1.5 KiB', '3.0 MiB')
    """
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
