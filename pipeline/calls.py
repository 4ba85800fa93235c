"""A step's and an evaluation's arguments, as ``Pipe`` and ``DistributedPipe`` take them.

``PipeBase.step`` and ``PipeBase.evaluate`` hold the one public signature of
each; they pack the arguments here for the subclass that runs them, and
``redocumented`` gives a subclass the same method under its own docstring.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from pipeline.arguments import LossReduction
from pipeline.runtime.microbatch import Batch, Value
from pipeline.step.losses import LossDivisor
from pipeline.step.schedules import Schedule

__all__ = ["EvaluateCall", "MicroBatches", "StepCall", "check_flags", "redocumented"]

_Method = TypeVar("_Method", bound=Callable[..., Any])


@dataclass(frozen=True)
class StepCall:
    """The arguments of one ``step`` call, unchecked."""

    input: Value | None
    target: Value | None
    loss_fn: Callable[[Value, Value], torch.Tensor]
    kwargs: Mapping[str, Value] | None
    schedule: str | Schedule
    loss_reduction: LossReduction | None
    loss_divisor: LossDivisor | None
    return_outputs: bool
    grad_scaler: torch.amp.GradScaler | None
    measure_memory: bool


@dataclass(frozen=True)
class EvaluateCall:
    """The arguments of one ``evaluate`` call, unchecked."""

    input: Value | None
    target: Value | None
    loss_fn: Callable[[Value, Value], torch.Tensor] | None
    kwargs: Mapping[str, Value] | None
    loss_reduction: LossReduction | None
    loss_divisor: LossDivisor | None
    return_outputs: bool


@dataclass(frozen=True)
class MicroBatches:
    """A call's input and target micro-batches here, and every micro-batch's rows."""

    batches: list[Batch]
    targets: list[Batch]
    rows: list[int]


def check_flags(**flags: object) -> None:
    """Refuse a flag given as anything but True or False (``"no"`` would read as True)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def redocumented(method: _Method, doc: str) -> _Method:
    """``method`` under the docstring ``doc``: one body, documented as each class runs it.

    Its signature, overloads included, stays ``method``'s (``inspect`` follows
    ``__wrapped__``).
    """

    @functools.wraps(method)
    def documented(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    documented.__doc__ = doc
    return cast(_Method, documented)
