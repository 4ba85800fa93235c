"""Gantt: a text chart of a traced step, one line per partition.

Each column is a slice of time; it shows the task that fills most of it, ``~``
when an action of ``Pipe.step`` waited for a message for most of it, or ``.``
when the partition was idle for most of it::

    step 3: time 0 .. 12.31 ms, 1 column = 0.17 ms
    partition 0 |FFFFffffFFFFffff........BBBBBbbbbbBBBBBbbbbb| idle 33.3% of this step
    partition 1 |....FFFFffffFFFFffffbbbbbBBBBBbbbbbBBBBB....| idle 33.3% of this step

The idle shares are this one step's; ``Trace.summary()``'s are over every
step traced.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.trace.event import Event, Kind, busy_time

__all__ = ["LEGEND", "render"]

_LETTERS: dict[Kind, str] = {
    "forward": "F",
    "backward": "B",
    "recompute": "R",
    "input_grad": "I",
    "weight_grad": "W",
    "copy": "C",
    "wait": "~",
}
LEGEND = (
    "F forward, B backward, R recompute, I input gradient, W weight gradient, C copy\n"
    "lower case: odd micro-batch; ~ waiting for a message; . idle"
)


def render(events: Sequence[Event], width: int = 72) -> str:
    """Chart ``events`` in ``width`` columns; the time axis spans them all.

    >>> print(render([Event("forward", 0, 0, 0, "t", 0.0, 0.001),
    ...               Event("forward", 0, 1, 0, "t", 0.001, 0.002)], width=4))
    step 0: time 0 .. 2.00 ms, 1 column = 0.50 ms
    partition 0 |FF..| idle 50.0% of this step
    partition 1 |..FF| idle 50.0% of this step
    F forward, B backward, R recompute, I input gradient, W weight gradient, C copy
    lower case: odd micro-batch; ~ waiting for a message; . idle
    """
    if width < 1:
        raise ValueError(f"width must be a positive number of columns, got {width}")
    if not events:
        return "(no tasks recorded)"
    origin = min(e.start for e in events)
    span = max(e.end for e in events) - origin
    column = span / width
    n = 1 + max(e.partition for e in events)
    label = len(f"partition {n - 1}")
    steps = sorted({e.step for e in events})
    which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
    lines = [f"{which}: time 0 .. {span * 1e3:.2f} ms, 1 column = {column * 1e3:.2f} ms"]
    of = "this step" if len(steps) == 1 else "these steps"
    for j in range(n):
        row = [e for e in events if e.partition == j]
        cells = "".join(_cell(row, origin + c * column, column) for c in range(width))
        busy = busy_time(row)
        idle = 1.0 - busy / span if span > 0 else 0.0
        lines.append(f"{f'partition {j}'.ljust(label)} |{cells}| idle {idle:.1%} of {of}")
    lines.append(LEGEND)
    return "\n".join(lines)


def _cell(events: Sequence[Event], start: float, length: float) -> str:
    best: Event | None = None
    best_overlap = waited = 0.0
    tasks = [e for e in events if e.kind != "wait"]
    for e in events:
        overlap = _overlap(e, start, length)
        if e.kind == "wait":
            waited += overlap
            continue
        # A task nested in this one (a recomputation inside its backward) fills
        # its own part: this one only the rest.
        overlap -= sum(_overlap(f, start, length) for f in tasks if f is not e and _inside(f, e))
        if overlap > best_overlap:
            best, best_overlap = e, overlap
    # A wait lies inside its action's task: the task fills only the rest.
    if waited >= length / 2:
        return _LETTERS["wait"]
    if best is None or best_overlap - waited < length / 2:
        return "."
    letter = _LETTERS[best.kind]
    return letter if best.microbatch % 2 == 0 else letter.lower()


def _overlap(e: Event, start: float, length: float) -> float:
    return max(min(e.end, start + length) - max(e.start, start), 0.0)


def _inside(inner: Event, outer: Event) -> bool:
    return outer.start <= inner.start and inner.end <= outer.end
