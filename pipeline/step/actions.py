"""Actions and programs: what a worker does in an explicit schedule, in torch's notation.

An action is one piece of work of one stage on one micro-batch:
``F`` (forward), ``B`` (backward), or backward split into ``I`` (input
gradient) and ``W`` (weight gradient). It is written as torch.distributed.
pipelining writes it: stage, kind, micro-batch, so ``1F3`` is the forward of
micro-batch 3 on stage 1 and ``0W2`` the weight gradient of micro-batch 2 on
stage 0. A program is the ordered list of actions one worker runs::

    worker 0: 0F0 0F1 0B0 0B1          worker 1: 1F0 1B0 1F1 1B1
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

__all__ = [
    "Action",
    "Kind",
    "Program",
    "backward_before_forward",
    "forwards_out_of_order",
    "parse_program",
]

Kind: TypeAlias = Literal["F", "B", "I", "W"]
Program: TypeAlias = list["Action"]

_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One stage's forward, backward, input-gradient or weight-gradient work on one micro-batch.

    >>> Action.parse("1F3")
    Action(stage=1, kind='F', microbatch=3)
    >>> str(Action(0, "W", 2))
    '0W2'
    """

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action written as ``text`` ("1F3")."""
        match = _ACTION.match(text.strip())
        if match is None:
            raise ValueError(
                f"{text!r} is not an action: write stage, kind and micro-batch, like '1F3' "
                "(kinds: F forward, B backward, I input gradient, W weight gradient)"
            )
        kind: Kind = match[2]  # type: ignore[assignment]
        return cls(int(match[1]), kind, int(match[3]))


def parse_program(program: str | Sequence[str | Action]) -> Program:
    """A program from text ("0F0 0F1 0B0") or a list of actions or their texts.

    >>> [str(a) for a in parse_program("0F0 0F1 0B0")]
    ['0F0', '0F1', '0B0']
    """
    items = program.split() if isinstance(program, str) else program
    # Anything else is left for validation to name.
    return [Action.parse(item) if isinstance(item, str) else item for item in items]


def backward_before_forward(programs: list[Program]) -> Action | None:
    """The first backward (B, I or W) a program runs before one of its forwards, or None.

    None when every program runs all its forwards first, as GPipe's do:
    then every forward of the step comes before any backward (each stage's
    first backward waits for the last stage's, which follows every forward).

    >>> backward_before_forward([parse_program("0F0 0F1 0B1 0B0")]) is None
    True
    >>> str(backward_before_forward([parse_program("0F0 0B0 0F1 0B1")]))
    '0B0'
    """
    for program in programs:
        forwards = [k for k, action in enumerate(program) if action.kind == "F"]
        early = [a for a in program[: forwards[-1]] if a.kind != "F"] if forwards else []
        if early:
            return early[0]
    return None


def forwards_out_of_order(programs: Sequence[Program], stage: int) -> tuple[int, int] | None:
    """The first micro-batch whose forward ``stage`` runs after a later one's, and that later
    one; or None when its forwards run in micro-batch order, as every built-in schedule's do.

    Items that are not actions are left for validation to name.

    >>> forwards_out_of_order([parse_program("0F1 0F0 0B0 0B1")], 0)
    (0, 1)
    >>> forwards_out_of_order([parse_program("0F0 0B0 0F1 0B1")], 0) is None
    True
    """
    latest: int | None = None
    for program in programs:
        for action in program:
            if not (isinstance(action, Action) and action.stage == stage and action.kind == "F"):
                continue
            if latest is not None and action.microbatch < latest:
                return action.microbatch, latest
            latest = action.microbatch
    return None
