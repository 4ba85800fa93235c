"""The planner's time model: a schedule's programs played with each stage's measured costs.

A stage's forward costs the sum of its layers' forward times (the loss's
too on the last stage), its backward the sum of their backward times plus
the forward again where the task is checkpointed (the recomputation runs
inside it); zero-bubble's ``I`` and ``W`` cost the input-gradient time and
the rest. Each action also costs ``overhead`` seconds (the library's own
work per action: mail, leaves, timing). The programs are played by
``pipeline.step.simulate.play``: an action starts when its worker is free
and its input has arrived; within one process communication costs nothing
(one memory), between processes a message takes the time ``links.py``
models: the predicted step time is the last action's end. On CPU,
an action runs slower while other workers compute (``contention.py``): a
second play slows each action by the share of the first play's overlap,
its forward work (a forward, a recomputation, the library's own work) by
the forward factor, its backward work by the backward one. A stage sharded
with FSDP2 (``sharding.py``) adds its units' all-gathers to its first
forward, before its output goes, and their reduce-scatters after its last
action, once its gradient went: the step ends when the last one ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.plan.contention import NO_CONTENTION, Contention
from pipeline.plan.links import CutSeconds, linked_programs
from pipeline.plan.profile import LayerTimes
from pipeline.step.actions import Action, Program
from pipeline.step.simulate import play

__all__ = ["StageCosts", "matching", "predicted_seconds", "stage_costs"]


@dataclass(frozen=True)
class StageCosts:
    """Seconds of one micro-batch through one stage: forward, backward, its two halves."""

    forward: float
    backward: float
    input_grad: float
    weight: float


def stage_costs(
    times: LayerTimes, first: int, stop: int, factor: Contention = NO_CONTENTION
) -> StageCosts:
    """The costs of the stage of layers ``first..stop`` (and the loss if it is the last).

    ``factor`` scales them: the CPU's contention (``contention.py``) on a CPU stage.
    """
    end = stop + 1 if stop == len(times.forward) - 1 else stop
    return StageCosts(
        factor.forward * sum(times.forward[first:end]),
        factor.backward * sum(times.backward[first:end]),
        factor.backward * sum(times.input_grad[first:end]),
        factor.backward * sum(times.weight[first:end]),
    )


def predicted_seconds(
    programs: list[Program],
    costs: list[StageCosts],
    checkpointed: set[tuple[int, int]],
    overhead: float,
    contention: list[Contention] | None = None,
    cuts: CutSeconds | None = None,
    collectives: Sequence[tuple[float, float]] | None = None,
) -> float:
    """The step's predicted seconds: ``programs`` played with ``costs[s]`` for stage ``s``.

    ``contention[s]`` (CPU stages; 1 elsewhere) is how much slower stage
    ``s`` runs while every other worker computes too: the programs are
    played once as they are, then again with each action slowed in
    proportion to the other workers busy while it ran in the first play.
    ``cuts``: the transfers between stages in different processes
    (``links.py``); None: communication costs nothing. ``collectives[s]``:
    stage ``s``'s all-gathers, in its first forward, and reduce-scatters,
    after its last action (sharded stages; None: none).

    >>> from pipeline.step.actions import parse_program
    >>> programs = [parse_program("0F0 0F1 0B0 0B1"), parse_program("1F0 1B0 1F1 1B1")]
    >>> one = StageCosts(1.0, 2.0, 1.0, 1.0)
    >>> predicted_seconds(programs, [one, one], set(), 0.0)
    9.0
    >>> predicted_seconds(programs, [one, one], set(), 0.0, collectives=[(0.5, 0.25)] * 2)
    10.25
    >>> twice = Contention(2.0, 2.0)
    >>> predicted_seconds(programs, [one, one], set(), 0.0, [twice, twice]) > 9.0
    True
    """
    worker = {a.stage: w for w, program in enumerate(programs) for a in program}
    fixed, after = _collective_seconds(programs, collectives)

    def parts(action: Action) -> tuple[float, float]:
        """The action's forward work (the library's own with it) and its backward work."""
        stage = costs[action.stage]
        again = stage.forward if (action.microbatch, action.stage) in checkpointed else 0.0
        forward, backward = {
            "F": (stage.forward, 0.0),
            "B": (again, stage.backward),
            "I": (again, stage.input_grad),
            "W": (0.0, stage.weight),
        }[action.kind]
        return forward + overhead, backward

    def cost(action: Action) -> float:
        return sum(parts(action)) + fixed.get(action, 0.0)

    start, end = _played(programs, len(costs), cost, cuts)
    if contention is not None and len(programs) > 1 and any(c != NO_CONTENTION for c in contention):
        others = _others_busy(start, end, worker, len(programs))

        def slowed(action: Action) -> float:
            share = others[action] / (len(programs) - 1)
            factor = contention[action.stage]
            forward, backward = parts(action)
            return (
                forward * (1 + (factor.forward - 1) * share)
                + backward * (1 + (factor.backward - 1) * share)
                + fixed.get(action, 0.0)
            )

        start, end = _played(programs, len(costs), slowed, cuts)
    return max([*end.values(), *(end[a] + s for a, s in after.items())], default=0.0)


Times = dict[Action, float]


def _collective_seconds(
    programs: list[Program], collectives: Sequence[tuple[float, float]] | None
) -> tuple[Times, Times]:
    """The seconds of each stage's collectives: its all-gathers, by its first forward, which
    they delay; its reduce-scatters, by its last action, after which they run."""
    gathers: Times = {}
    reduces: Times = {}
    if collectives is None:
        return gathers, reduces
    for program in programs:
        for stage in {a.stage for a in program}:
            mine = [a for a in program if a.stage == stage]
            gathers[next(a for a in mine if a.kind == "F")], reduces[mine[-1]] = collectives[stage]
    return gathers, reduces


def _played(
    programs: list[Program], stages: int, cost: Callable[[Action], float], cuts: CutSeconds | None
) -> tuple[Times, Times]:
    """``play``'s starts and ends of the stages' actions, each transfer played as a link's."""
    if cuts is None:
        return play(programs, stages, cost)
    linked, original = linked_programs(programs, stages)

    def linked_cost(action: Action) -> float:
        if action in original:
            return cost(original[action])
        transfers = cuts.forward if action.kind == "F" else cuts.backward
        return transfers[action.stage // 2]

    start, end = play(linked, 2 * stages - 1, linked_cost)
    return (
        {original[a]: t for a, t in start.items() if a in original},
        {original[a]: t for a, t in end.items() if a in original},
    )


def _others_busy(
    start: dict[Action, float], end: dict[Action, float], worker: dict[int, int], workers: int
) -> dict[Action, float]:
    """For each action, how many other workers ran an action meanwhile, on average over it."""
    spans: list[list[tuple[float, float]]] = [[] for _ in range(workers)]
    for action, begin in start.items():
        spans[worker[action.stage]].append((begin, end[action]))
    busy: dict[Action, float] = {}
    for action, begin in start.items():
        finish = end[action]
        length = finish - begin
        mine = worker[action.stage]
        shared = sum(
            max(0.0, min(finish, b) - max(begin, a))
            for w in range(workers)
            if w != mine
            for a, b in spans[w]
        )
        busy[action] = shared / length if length > 0 else 0.0
    return busy


def matching(played: Callable[[float], float], seconds: float, low: float, high: float) -> float:
    """The value in ``low..high`` at which the increasing ``played`` takes ``seconds``, by
    bisection; ``low`` or ``high`` where even that end plays longer or shorter.

    >>> round(matching(lambda x: 2 * x, 3.0, 0.0, 10.0), 6)
    1.5
    >>> matching(lambda x: 2 * x + 5, 3.0, 0.0, 10.0)
    0.0
    """
    if played(low) >= seconds:
        return low
    if played(high) <= seconds:
        return high
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if played(middle) < seconds else (low, middle)
    return (low + high) / 2
