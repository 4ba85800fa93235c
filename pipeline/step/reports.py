"""What a step ran: ``pipe.last_step``."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.step.schedules import Schedule
from pipeline.step.simulate import Simulation

__all__ = ["DistributedStepReport", "StepReport"]


@dataclass(frozen=True)
class StepReport:
    """What the last ``Pipe.step`` ran: its schedule, the simulation, what it held.

    ``peak_in_flight[j]`` is the most micro-batches partition ``j`` held at
    once (forwarded, not yet fully back-propagated), as measured; it equals
    ``simulation.peak_in_flight`` for every valid program.
    """

    schedule: Schedule
    simulation: Simulation
    peak_in_flight: list[int]


@dataclass(frozen=True)
class DistributedStepReport:
    """What this process ran in the last step.

    ``received`` counts the messages that came from each peer, by kind
    (``"act"``, ``"grad"``, ``"skip"``, ``"skip-grad"``): ``{(rank, kind): count}``.
    """

    schedule: Schedule
    simulation: Simulation
    peak_in_flight: dict[int, int]
    received: dict[tuple[int, str], int]
