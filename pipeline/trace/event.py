"""Event: one task of the pipeline, where it ran and when."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, TypeAlias

__all__ = ["COMPUTE_KINDS", "KINDS", "Event", "Kind", "busy_time", "covered_time", "task_name"]

Kind: TypeAlias = Literal[
    "forward", "backward", "recompute", "input_grad", "weight_grad", "copy", "wait"
]
KINDS: tuple[Kind, ...] = (
    "forward",
    "backward",
    "recompute",
    "input_grad",
    "weight_grad",
    "copy",
    "wait",
)
# Copies are issued by the driver thread, not computed by the partition. A
# wait (an action of Pipe.step waiting for a message) lies inside its action's
# event, and is not computed either.
COMPUTE_KINDS: frozenset[Kind] = frozenset(
    {"forward", "backward", "recompute", "input_grad", "weight_grad"}
)


@dataclass(frozen=True)
class Event:
    """A task of kind ``kind`` on micro-batch ``microbatch`` and partition ``partition``.

    ``start`` and ``end`` are ``time.perf_counter()`` seconds; ``step`` counts
    the Pipe's forward passes within the trace; ``thread`` names the thread
    that ran the task. A copy's ``partition`` is the one it copies into; a
    wait's is the partition whose action waited.

    >>> Event("forward", 3, 1, 0, "pipe-partition-1", 0.010, 0.012).name
    'pipe.forward[mb=3,part=1]'
    """

    kind: Kind
    microbatch: int
    partition: int
    step: int
    thread: str
    start: float
    end: float

    @property
    def name(self) -> str:
        """The stable name shared with ``torch.profiler`` ranges."""
        return task_name(self.kind, self.microbatch, self.partition)

    @property
    def duration(self) -> float:
        return self.end - self.start


def task_name(kind: Kind, microbatch: int, partition: int) -> str:
    """The name of a task, such as ``pipe.copy[mb=3,part=0->1]``.

    >>> task_name("forward", 3, 1)
    'pipe.forward[mb=3,part=1]'
    """
    where = f"{partition - 1}->{partition}" if kind == "copy" else str(partition)
    return f"pipe.{kind}[mb={microbatch},part={where}]"


def busy_time(events: Iterable[Event]) -> float:
    """The time ``events`` computed: covered by a compute task, less the waits inside them.

    >>> busy_time([Event("forward", 0, 1, 0, "t", 0.0, 3.0),
    ...            Event("wait", 0, 1, 0, "t", 0.0, 1.0)])
    2.0
    """
    events = list(events)
    computing = covered_time(e for e in events if e.kind in COMPUTE_KINDS)
    return computing - covered_time(e for e in events if e.kind == "wait")


def covered_time(events: Iterable[Event]) -> float:
    """The time covered by at least one of ``events`` (overlaps counted once).

    >>> covered_time([Event("forward", 0, 0, 0, "t", 0.0, 2.0),
    ...               Event("backward", 0, 0, 0, "t", 1.0, 3.0)])
    3.0
    """
    total = 0.0
    reach = float("-inf")
    for event in sorted(events, key=lambda e: e.start):
        if event.end <= reach:
            continue
        total += event.end - max(event.start, reach)
        reach = event.end
    return total
