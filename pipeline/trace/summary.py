"""Summary: busy and idle time per partition, beside GPipe's bubble bound."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.clock.cycles import bubble_fraction
from pipeline.trace.event import COMPUTE_KINDS, KINDS, Event, Kind, busy_time

__all__ = ["PartitionSummary", "Summary", "summarize"]


@dataclass(frozen=True)
class PartitionSummary:
    """One partition's time over the traced steps, in seconds.

    ``busy`` is the time it computed (forward, backward or recompute; overlaps
    counted once), less the time its actions waited for a message
    (``Pipe.step``); ``idle_fraction`` is the rest of the steps' time, as a
    share of it, waits included. ``time_by_kind`` sums the durations of each
    kind of task (``"wait"``: the waits, which lie inside their actions).
    """

    partition: int
    busy: float
    idle_fraction: float
    time_by_kind: dict[Kind, float]


@dataclass(frozen=True)
class Summary:
    """Where the time of the traced steps went, partition by partition.

    ``window`` is the time from each step's first task to its last, summed
    over ``steps``; ``bubble_bound`` is GPipe's idle share (n-1)/(m+n-1) for
    ``microbatches`` (m) and ``partitions`` (n) equal tasks. For steps run
    with an explicit schedule (``Pipe.step``, ``Pipe.evaluate``),
    ``schedule_bound`` is the mean of their programs' own idle shares per
    partition (each step weighing as its window), simulated with unit costs
    on the threads the steps ran on
    (``StepReport.simulated_idle.stages``). ``mixed``: the steps were of both
    kinds (``pipe(x)`` and explicit), so neither bound is theirs and the
    table names none. ``str()`` gives a table::

        print(trace.summary())
    """

    steps: int
    microbatches: int
    window: float
    partitions: list[PartitionSummary]
    bubble_bound: float
    schedule_bound: float | None = None
    mixed: bool = False

    @property
    def idle_fraction(self) -> float:
        """The idle share of all partitions together (0 when nothing was traced)."""
        if not self.partitions:
            return 0.0
        return sum(p.idle_fraction for p in self.partitions) / len(self.partitions)

    def __str__(self) -> str:
        if not self.partitions:
            return "pipeline trace: no tasks recorded"
        n = len(self.partitions)
        head = (
            f"pipeline trace: {self.steps} step(s), {self.microbatches} micro-batches, "
            f"{n} partitions, {_ms(self.window / self.steps)} per step"
        )
        columns = ["partition", *KINDS, "busy", "idle"]
        rows = [columns] + [_row(p) for p in self.partitions]
        widths = [max(len(row[k]) for row in rows) for k in range(len(columns))]
        table = [
            "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        over = f"over all {self.steps} steps" if self.steps > 1 else "over the step"
        foot = f"idle (bubble) fraction {over} {self.idle_fraction:.1%}; " + self._bound(n)
        return "\n".join([head, *table, foot])

    def _bound(self, n: int) -> str:
        if self.mixed:
            return "steps of pipe(x) and of explicit schedules mixed: no one bound to compare"
        if self.schedule_bound is not None:
            return f"the schedule's simulated idle fraction {self.schedule_bound:.1%}"
        return (
            f"GPipe bound (n-1)/(m+n-1) = ({n}-1)/({self.microbatches}+{n}-1) = "
            f"{self.bubble_bound:.1%}"
        )


def summarize(events: Sequence[Event], schedule_bounds: Sequence[float] = ()) -> Summary:
    """Summarise ``events``; idle time is measured within each step's window.

    ``schedule_bounds`` are the simulated idle fractions of the explicit
    schedules the steps ran, if any: one per step when all were explicit.

    >>> s = summarize([Event("forward", 0, 0, 0, "t", 0.0, 1.0),
    ...                Event("forward", 0, 1, 0, "t", 1.0, 2.0)])
    >>> [p.idle_fraction for p in s.partitions], s.bubble_bound
    ([0.5, 0.5], 0.5)
    """
    if not events:
        return Summary(steps=0, microbatches=0, window=0.0, partitions=[], bubble_bound=0.0)
    windows = _step_windows(events)
    window = sum(end - start for start, end in windows.values())
    n = 1 + max(e.partition for e in events)
    m = 1 + max(e.microbatch for e in events)
    partitions = [
        _partition_summary(j, [e for e in events if e.partition == j], window) for j in range(n)
    ]
    every_step = len(schedule_bounds) == len(windows)
    # Each step's bound weighs as its window does in the idle share.
    spans = [end - start for start, end in (windows[k] for k in sorted(windows))]
    bound = sum(b * w for b, w in zip(schedule_bounds, spans, strict=False)) / window
    return Summary(
        steps=len(windows),
        microbatches=m,
        window=window,
        partitions=partitions,
        bubble_bound=bubble_fraction(m, n),
        schedule_bound=bound if every_step and window > 0 else None,
        mixed=bool(schedule_bounds) and not every_step,
    )


def _step_windows(events: Sequence[Event]) -> dict[int, tuple[float, float]]:
    """Each step's (first start, last end)."""
    windows: dict[int, tuple[float, float]] = {}
    for e in events:
        start, end = windows.get(e.step, (e.start, e.end))
        windows[e.step] = (min(start, e.start), max(end, e.end))
    return windows


def _partition_summary(partition: int, events: list[Event], window: float) -> PartitionSummary:
    by_step: dict[int, list[Event]] = defaultdict(list)
    time_by_kind: dict[Kind, float] = dict.fromkeys(KINDS, 0.0)
    for e in events:
        time_by_kind[e.kind] += e.duration
        if e.kind in COMPUTE_KINDS or e.kind == "wait":
            by_step[e.step].append(e)
    # Steps are covered separately so that time between steps is not busy.
    busy = sum(busy_time(step_events) for step_events in by_step.values())
    idle = 1.0 - busy / window if window > 0 else 0.0
    # Clamped because summing the covered pieces may round past the window.
    return PartitionSummary(partition, busy, min(max(idle, 0.0), 1.0), time_by_kind)


def _row(p: PartitionSummary) -> list[str]:
    return [
        str(p.partition),
        *(_ms(p.time_by_kind[kind]) for kind in KINDS),
        _ms(p.busy),
        f"{p.idle_fraction:.1%}",
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"
