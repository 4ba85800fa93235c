"""The planner's time model: a schedule's programs played with each stage's measured costs.

A stage's forward costs the sum of its layers' forward times (the loss's
too on the last stage; on a CPU stage times the contention of the CPU's
workers, ``contention.py``), its backward the sum of their backward times plus
the forward again where the task is checkpointed (the recomputation runs
inside it); zero-bubble's ``I`` and ``W`` cost the input-gradient time and
the rest. Each action also costs ``overhead`` seconds (the library's own
work per action: mail, leaves, timing). The programs are played by
``pipeline.step.simulate.play``: an action starts when its worker is free
and its input has arrived, and communication costs nothing (one process,
one memory): the predicted step time is the last action's end.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.plan.profile import LayerTimes
from pipeline.step.actions import Action, Program
from pipeline.step.simulate import play

__all__ = ["StageCosts", "predicted_seconds", "stage_costs"]


@dataclass(frozen=True)
class StageCosts:
    """Seconds of one micro-batch through one stage: forward, backward, its two halves."""

    forward: float
    backward: float
    input_grad: float
    weight: float


def stage_costs(times: LayerTimes, first: int, stop: int, factor: float = 1.0) -> StageCosts:
    """The costs of the stage of layers ``first..stop`` (and the loss if it is the last).

    ``factor`` scales them: the CPU's contention (``contention.py``) on a CPU stage.
    """
    end = stop + 1 if stop == len(times.forward) - 1 else stop
    return StageCosts(
        factor * sum(times.forward[first:end]),
        factor * sum(times.backward[first:end]),
        factor * sum(times.input_grad[first:end]),
        factor * sum(times.weight[first:end]),
    )


def predicted_seconds(
    programs: list[Program],
    costs: list[StageCosts],
    checkpointed: set[tuple[int, int]],
    overhead: float,
) -> float:
    """The step's predicted seconds: ``programs`` played with ``costs[s]`` for stage ``s``."""

    def cost(action: Action) -> float:
        stage = costs[action.stage]
        again = stage.forward if (action.microbatch, action.stage) in checkpointed else 0.0
        seconds = {
            "F": stage.forward,
            "B": stage.backward + again,
            "I": stage.input_grad + again,
            "W": stage.weight,
        }[action.kind]
        return seconds + overhead

    _, end = play(programs, len(costs), cost)
    return max(end.values(), default=0.0)
