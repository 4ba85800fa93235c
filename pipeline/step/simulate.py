"""Validate programs before running them, and predict their bubble and memory.

``validate`` refuses, with a message naming the actions, any set of programs
that could not run to the end:

- an action naming a stage or micro-batch that does not exist, or a stage
  whose actions are split over several workers;
- a stage and micro-batch without exactly one forward and one backward
  (``B``, or ``I`` and ``W``);
- on a worker, a backward before its forward or a ``W`` before its ``I``;
- a deadlock: the programs are played with their dependencies (a forward
  needs the previous stage's forward of its micro-batch, a backward the next
  stage's backward, or the loss), and if every worker waits for another one
  the waiting actions are named.

Playing them with costs (forward 1, backward 2, input and weight gradients 1
each) gives the schedule's own idle fraction, and counting forwards minus
finished backwards along each program gives the peak number of micro-batches
each stage holds, which the runtime's stash reaches exactly. It also gives
an order in which one thread can run every program (``one_thread_order``).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeline.step.actions import Action, Kind, Program

__all__ = ["COSTS", "Idle", "ProgramError", "Simulation", "forward_idle", "play", "validate"]

COSTS: dict[Kind, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


class ProgramError(ValueError):
    """A set of programs that cannot run: incomplete, out of order, or deadlocked."""


@dataclass(frozen=True)
class Idle:
    """The simulated idle shares of a step, its programs on the workers that run them.

    ``workers``: the mean share of the makespan in which a worker (a thread,
    a process) runs no action. ``stages``: the mean share in which a stage
    runs none of its own; a worker running several stages (interleaved,
    partitions sharing a thread) keeps each one idle while it runs another.
    """

    workers: float
    stages: float


@dataclass(frozen=True)
class Simulation:
    """How the programs play out with unit costs (``COSTS``).

    ``idle_fraction[w]`` is worker ``w``'s share of the makespan spent
    waiting; ``peak_in_flight[s]`` the most micro-batches stage ``s`` holds
    at once (forwarded, not yet fully back-propagated); ``start`` when each
    action starts; ``one_thread_order`` every action, in an order one thread
    running all the programs can follow (``one_thread_order``).
    """

    makespan: float
    idle_fraction: list[float]
    peak_in_flight: list[int]
    start: dict[Action, float]
    one_thread_order: tuple[Action, ...]
    _idle: dict[tuple[int, ...], Idle] = field(default_factory=dict, compare=False, repr=False)

    @property
    def mean_idle_fraction(self) -> float:
        return sum(self.idle_fraction) / len(self.idle_fraction)

    def idle_on(self, programs: list[Program], worker_of_program: Sequence[int]) -> Idle:
        """The idle shares when worker ``worker_of_program[k]`` runs ``programs[k]``.

        Programs that share a worker (partitions on one thread) run one at a
        time, each worker's in ``thread_order``'s order; unit costs, as
        ``validate``. With a worker each, ``workers`` is ``mean_idle_fraction``.

        >>> from pipeline.step.actions import parse_program
        >>> programs = [parse_program("0F0 0B0"), parse_program("1F0 1B0")]
        >>> simulation = validate(programs, 1, 2)
        >>> simulation.idle_on(programs, [0, 1])
        Idle(workers=0.5, stages=0.5)
        >>> simulation.idle_on(programs, [0, 0])
        Idle(workers=0.0, stages=0.5)
        """
        key = tuple(worker_of_program)
        found = self._idle.get(key)
        if found is None:
            found = self._idle[key] = self._idle_on(programs, key)
        return found

    def _idle_on(self, programs: list[Program], worker_of_program: tuple[int, ...]) -> Idle:
        groups: dict[int, list[Program]] = {}
        for k, program in enumerate(programs):
            groups.setdefault(worker_of_program[k], []).append(program)
        alone = len(groups) == 1
        merged = [list(self.thread_order(group, alone)) for group in groups.values()]
        return _idle_of_merged(merged, len(self.peak_in_flight))

    def thread_order(self, programs: list[Program], alone: bool) -> Sequence[Action]:
        """The actions of ``programs``, all run by one thread, in an order it can follow.

        ``alone``: the thread runs every program (``one_thread_order``).
        Otherwise other threads run the rest, each in this same way: the
        actions in the order they started in the play. Each action then
        waits only for actions that started before it in the play, so the
        pending action that started first can always run (no deadlock), and
        the thread's order, hence what it draws from a generator it owns, is
        the same at every step.
        """
        if alone:
            return self.one_thread_order
        return sorted(itertools.chain.from_iterable(programs), key=self.start.__getitem__)


def forward_idle(programs: list[Program], worker_of_program: Sequence[int], stages: int) -> Idle:
    """The idle shares of forward-only ``programs`` (an evaluation's), with unit costs, when
    worker ``worker_of_program[k]`` runs ``programs[k]``: a worker's actions in the order
    they start when each program runs alone (a forward waits only for an earlier stage's).
    A worker of several stages beside other workers (``threads="device"`` over several
    devices) runs an evaluation's actions as their mail comes (``runner.py``), which may
    not reach this order: the share is a lower bound there.

    >>> from pipeline.step.actions import parse_program
    >>> programs = [parse_program("0F0 0F1"), parse_program("1F0 1F1")]
    >>> round(forward_idle(programs, [0, 1], 2).stages, 6)  # GPipe's (n - 1) / (m + n - 1)
    0.333333
    >>> forward_idle(programs, [0, 0], 2)
    Idle(workers=0.0, stages=0.5)
    """
    start, _ = play(programs, stages)
    groups: dict[int, list[Action]] = {}
    for k, program in enumerate(programs):
        groups.setdefault(worker_of_program[k], []).extend(program)
    merged = [sorted(group, key=start.__getitem__) for group in groups.values()]
    return _idle_of_merged(merged, stages)


def _idle_of_merged(merged: list[Program], stages: int) -> Idle:
    """The idle shares of playing ``merged``, one program per worker, with unit costs."""
    start, end = play(merged, stages)
    makespan = max(end.values(), default=0.0)
    if not makespan:
        return Idle(0.0, 0.0)
    busy_by_stage = [0.0] * stages
    for action, ended in end.items():
        busy_by_stage[action.stage] += ended - start[action]
    busy = [sum(end[a] - start[a] for a in program) for program in merged]
    return Idle(
        workers=sum(1.0 - b / makespan for b in busy) / len(busy),
        stages=sum(1.0 - b / makespan for b in busy_by_stage) / stages,
    )


def validate(programs: list[Program], m: int, stages: int) -> Simulation:
    """Check ``programs`` (one per worker) for ``m`` micro-batches over ``stages`` stages.

    >>> validate([[Action(0, "F", 0), Action(0, "B", 0)]], 1, 1).peak_in_flight
    [1]
    """
    worker_of = _check_actions(programs, m, stages)
    _check_counts(programs, m, stages)
    _check_order(programs)
    start, end = play(programs, stages)
    makespan = max(end.values(), default=0.0)
    busy = [sum(COSTS[a.kind] for a in program) for program in programs]
    idle = [1.0 - b / makespan if makespan else 0.0 for b in busy]
    peaks = [
        _peak_in_flight([a for a in programs[worker_of[s]] if a.stage == s]) for s in range(stages)
    ]
    return Simulation(makespan, idle, peaks, start, one_thread_order(programs, stages, start))


def one_thread_order(
    programs: list[Program], stages: int, start: dict[Action, float]
) -> tuple[Action, ...]:
    """Every action of ``programs``, in an order one thread can run them all.

    Each program keeps its own order, and an action comes after what it
    needs (``_dependencies``: the forward or backward that mails it its
    activation or gradient; a skip's mail comes from an action that those
    need in turn), so its mail is there when it starts. Of the programs'
    next actions that could run, the order takes one of the kind just run
    (a forward after a forward, a backward after a backward: alternating
    the two costs the thread cache misses), the earliest in the play
    (``start``) among them. One is always there: the next action that
    started first in the play needs only actions that started before it.

    >>> from pipeline.step.actions import parse_program
    >>> programs = [parse_program("0F0 0F1 0B0 0B1"), parse_program("1F0 1B0 1F1 1B1")]
    >>> " ".join(map(str, validate(programs, 2, 2).one_thread_order))
    '0F0 0F1 1F0 1B0 0B0 1F1 1B1 0B1'
    """
    done: set[Action | tuple[int, str, int]] = set()
    position = [0] * len(programs)
    order: list[Action] = []
    kind: Kind | None = None
    for _ in range(sum(len(program) for program in programs)):
        ready = [
            (w, program[position[w]])
            for w, program in enumerate(programs)
            if position[w] < len(program)
            and all(d in done for d in _dependencies(program[position[w]], stages))
        ]
        alike = [(w, a) for w, a in ready if a.kind == kind]
        w, action = min(alike or ready, key=lambda ready_action: start[ready_action[1]])
        position[w] += 1
        order.append(action)
        done.add(action)
        if action.kind in ("B", "I"):
            done.add((action.stage, "grad", action.microbatch))
        kind = action.kind
    return tuple(order)


def _check_actions(programs: list[Program], m: int, stages: int) -> dict[int, int]:
    worker_of: dict[int, int] = {}
    for w, program in enumerate(programs):
        for action in program:
            if not isinstance(action, Action) or not _well_formed(action):
                raise ProgramError(
                    f"worker {w}'s program holds {action!r}, which is not an action: give "
                    "Action(stage, kind, micro-batch) with int stage and micro-batch and a "
                    "kind of 'F', 'B', 'I', 'W' (or its text, '1F3', through parse_program)"
                )
            if not (0 <= action.stage < stages and 0 <= action.microbatch < m):
                raise ProgramError(
                    f"action {action} of worker {w} names stage {action.stage} or micro-batch "
                    f"{action.microbatch}, but there are {stages} stages and {m} micro-batches"
                )
            first = worker_of.setdefault(action.stage, w)
            if first != w:
                raise ProgramError(
                    f"stage {action.stage} has actions on workers {first} and {w}; a stage's "
                    "actions must all be in one worker's program"
                )
    return worker_of


def _well_formed(action: Action) -> bool:
    return type(action.stage) is int and type(action.microbatch) is int and action.kind in COSTS


def _check_counts(programs: list[Program], m: int, stages: int) -> None:
    counts: dict[tuple[int, int], dict[Kind, int]] = defaultdict(lambda: defaultdict(int))
    for program in programs:
        for action in program:
            counts[action.stage, action.microbatch][action.kind] += 1
    problems = []
    for s in range(stages):
        for i in range(m):
            seen = counts[s, i]
            whole = seen["F"] == 1 and seen["B"] == 1 and seen["I"] == seen["W"] == 0
            split = seen["F"] == 1 and seen["B"] == 0 and seen["I"] == seen["W"] == 1
            if not (whole or split):
                listed = ", ".join(f"{n} x {k}" for k, n in sorted(seen.items()) if n) or "none"
                problems.append(f"stage {s}, micro-batch {i}: {listed}")
    if problems:
        shown = "; ".join(problems[:6]) + (
            f"; and {len(problems) - 6} more" if len(problems) > 6 else ""
        )
        raise ProgramError(
            "every stage and micro-batch needs one F and either one B or one I and one W; "
            f"found {shown}"
        )


def _check_order(programs: list[Program]) -> None:
    for w, program in enumerate(programs):
        position = {action: k for k, action in enumerate(program)}
        for action in program:
            before: Kind | None = {"B": "F", "I": "F", "W": "I", "F": None}[action.kind]
            if before is None:
                continue
            needed = Action(action.stage, before, action.microbatch)
            if position[needed] > position[action]:
                raise ProgramError(f"worker {w} runs {action} before {needed}")


def _dependencies(action: Action, stages: int) -> list[Action | tuple[int, str, int]]:
    """What must have finished before ``action`` can start (on any worker)."""
    s, i = action.stage, action.microbatch
    if action.kind == "F":
        return [Action(s - 1, "F", i)] if s > 0 else []
    if action.kind == "W":
        return [Action(s, "I", i)]
    if s == stages - 1:
        return [Action(s, "F", i)]
    return [(s + 1, "grad", i)]


def play(
    programs: list[Program], stages: int, cost: Callable[[Action], float] | None = None
) -> tuple[dict[Action, float], dict[Action, float]]:
    """Start and end time of every action, running each program in order.

    ``cost(action)`` is the action's duration: by default ``COSTS`` of its
    kind (what ``validate`` plays); the planner (``pipeline/plan/``) gives
    each stage's measured times instead. An action starts when its worker is
    free and what it needs has ended; waits cost nothing else.

    >>> from pipeline.step.actions import parse_program
    >>> programs = [parse_program("0F0 0B0"), parse_program("1F0 1B0")]
    >>> start, end = play(programs, 2, lambda a: 3.0 if a.stage == 1 else 1.0)
    >>> end[Action(0, "B", 0)]
    8.0
    """
    duration = cost if cost is not None else _unit_cost
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    grad_ready: dict[tuple[int, str, int], float] = {}
    clock = [0.0] * len(programs)
    next_action = [0] * len(programs)
    remaining = sum(len(p) for p in programs)
    while remaining:
        progressed = False
        for w, program in enumerate(programs):
            while next_action[w] < len(program):
                action = program[next_action[w]]
                ready = [
                    end.get(d) if isinstance(d, Action) else grad_ready.get(d)
                    for d in _dependencies(action, stages)
                ]
                if any(r is None for r in ready):
                    break
                start[action] = max([clock[w], *(r for r in ready if r is not None)])
                end[action] = clock[w] = start[action] + duration(action)
                if action.kind in ("B", "I"):
                    grad_ready[action.stage, "grad", action.microbatch] = end[action]
                next_action[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = [
                f"worker {w} at {programs[w][next_action[w]]}"
                for w in range(len(programs))
                if next_action[w] < len(programs[w])
            ]
            raise ProgramError(
                "the programs deadlock: every worker waits for an action another one has not "
                f"run yet ({', '.join(waiting)})"
            )
    return start, end


def _unit_cost(action: Action) -> float:
    return COSTS[action.kind]


def _peak_in_flight(program: Program) -> int:
    """The most micro-batches forwarded and not yet fully back-propagated along ``program``."""
    held = peak = 0
    for action in program:
        if action.kind == "F":
            held += 1
            peak = max(peak, held)
        elif action.kind in ("B", "W"):
            held -= 1
    return peak
