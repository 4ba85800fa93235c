"""Programs validated once per pipe: keyed by the programs themselves, never by a name.

A step asks its schedule for the programs of ``m`` micro-batches and runs
them only once ``simulate.validate`` has accepted them. The validation is
kept for the next steps under the programs' own actions (and ``m`` and the
stage count, for which they were valid), so two schedules
that happen to print alike (a schedule of one's own without a ``__repr__``)
still run their own programs. Only the built-in schedules, whose ``repr``
names everything their programs depend on, also keep their programs from one
step to the next; any other schedule is asked at every step.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.step.actions import Program, parse_program
from pipeline.step.schedules import (
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Programs,
    Schedule,
    ZeroBubbleH1,
)
from pipeline.step.simulate import ProgramError, Simulation, validate

__all__ = ["ProgramCache", "described_by_repr", "programs_of"]

# The schedules whose programs for (m, stages) depend on nothing but their
# repr: exactly these classes, not their subclasses, which may add to them.
_DESCRIBED_BY_REPR = (GPipe, OneFOneB, ZeroBubbleH1, Interleaved1F1B, Programs)


def described_by_repr(schedule: Schedule) -> bool:
    """Whether ``schedule``'s programs depend on nothing but its ``repr`` (a built-in one)."""
    return type(schedule) in _DESCRIBED_BY_REPR


def programs_of(schedule: Schedule, m: int, stages: int) -> list[Program]:
    """``schedule``'s programs for ``m`` micro-batches: a list each (a schedule of one's own
    may give iterators, read once), and a program's text parsed as ``Programs`` takes it."""
    given = schedule.programs(m, stages)
    if isinstance(given, str) or not isinstance(given, Iterable):
        raise ProgramError(
            f"{schedule!r}.programs({m}, {stages}) returned {given!r}: return one program per "
            "worker, each a list of actions or their text ('0F0 0B0')"
        )
    return [parse_program(program) for program in given]


class ProgramCache:
    """The programs a pipe has run, each with its validation."""

    def __init__(self) -> None:
        self._validated: dict[
            tuple[int, int, tuple[tuple[tuple[type, str], ...], ...]], Simulation
        ] = {}
        self._built_in: dict[tuple[str, int], list[Program]] = {}

    def programs(self, schedule: Schedule, m: int, stages: int) -> tuple[list[Program], Simulation]:
        """``schedule``'s programs for ``m`` micro-batches over ``stages`` stages, validated."""
        key = (repr(schedule), m) if described_by_repr(schedule) else None
        programs = self._built_in.get(key) if key is not None else None
        if programs is None:
            programs = programs_of(schedule, m, stages)
        # By type and text: an action is a dataclass, and Action(0, "F", 1.0) or
        # Action(0, "F", True) equals Action(0, "F", 1), which validation refuses. With m
        # and stages: programs valid for 2 micro-batches are not for 4.
        actions = tuple(tuple((type(a), str(a)) for a in program) for program in programs)
        simulation = self._validated.get((m, stages, actions))
        if simulation is None:
            simulation = self._validated[m, stages, actions] = validate(programs, m, stages)
        if key is not None:
            self._built_in[key] = programs
        return programs, simulation
