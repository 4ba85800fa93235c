"""The schedules of Pipe.step and DistributedPipe.step: built in, your own, and their checks.

The engine lives in ``pipeline/step/``; this module gathers what a user imports::

    from pipeline.schedules import Programs
    pipe.step(x, y, loss_fn, schedule=Programs(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]))
"""

from pipeline.step.actions import Action
from pipeline.step.schedules import (
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Programs,
    Schedule,
    ZeroBubbleH1,
    ZeroBubbleMemory,
    resolve_schedule,
)
from pipeline.step.simulate import ProgramError, Simulation, validate

__all__ = [
    "Action",
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "ProgramError",
    "Programs",
    "Schedule",
    "Simulation",
    "ZeroBubbleH1",
    "ZeroBubbleMemory",
    "resolve_schedule",
    "validate",
]
